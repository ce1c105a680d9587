"""The microbenchmarks of ``moesim calibrate``, one module per kind of thing measured.

Driver side (no torch; :mod:`hw_validate.calibrate` imports them): :mod:`~.spec` (what to measure,
from the scenarios' own shapes) and :mod:`~.runner` (launches the job and supervises it). Rank
side (imported by every rank of the job, ``hw_validate/microbench.py``): :mod:`~.harness` (the
timing loops), :mod:`~.compute` (GEMMs, attention, memory-bound ops, the launch cost),
:mod:`~.collectives` (all-to-all, all-reduce, all-gather sweeps), :mod:`~.cpu_ranks` (compute noise
and late wake-ups of CPU ranks), :mod:`~.optimizer` (the optimizer step and ZeRO's gradient hooks)
and :mod:`~.dispatcher` (DeepSpeed's token dispatcher).
"""
