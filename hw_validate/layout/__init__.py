"""Real pipeline- and tensor-parallel jobs on local ranks, timed with the simulator's span names and
compared with the simulator (issue 27 item 5).

Rank side (imports torch; each file is the script every rank runs under ``torchrun``):

- :mod:`~hw_validate.layout.timeline`      -- the rank's span recorder, the job's shared flags and the
  measurement file every rank's spans end up in;
- :mod:`~hw_validate.layout.pipeline_rank` -- ``torch.distributed.pipelining`` (``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``) on the scenario's dense transformer, its stages as the simulator splits them;
- :mod:`~hw_validate.layout.tp_rank`       -- ``torch.distributed.tensor.parallel`` (colwise/rowwise
  GEMMs, sequence parallelism) on the same model.

Driver side (no torch): :mod:`~hw_validate.layout.run` launches a rank script and supervises it,
:mod:`~hw_validate.layout.quantities` reduces spans (measured or simulated) to the compared
quantities, :mod:`~hw_validate.layout.compare` simulates the scenario with a calibration and writes
measured against predicted. The entry points are ``python -m hw_validate.pipeline_job`` and
``python -m hw_validate.tp_job``.
"""
