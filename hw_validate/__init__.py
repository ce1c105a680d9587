"""The real-hardware side of moesim: the same scenario files run as real DeepSpeed expert-parallel jobs.

Modules (one concept each):

- :mod:`hw_validate.dsconfig`    -- the DeepSpeed config derived from a scenario (batch sizes checked).
- :mod:`hw_validate.model`       -- the torch Transformer with ``deepspeed.moe.layer.MoE`` FFNs.
- :mod:`hw_validate.data`        -- the seeded synthetic next-token task.
- :mod:`hw_validate.timing`      -- per-phase timers (forward hooks, comm wrapping, CUDA events / wall clock).
- :mod:`hw_validate.router_trace` -- records the gate's per-expert counts as a ``moesim.router_trace`` file.
- :mod:`hw_validate.measurement` -- the versioned Measurement JSON (schema, writer, loader).
- :mod:`hw_validate.upcycle`     -- sparse upcycling of a dense checkpoint into the MoE model.
- :mod:`hw_validate.train_moe`   -- the training entry point run by ``deepspeed`` or ``torchrun``.
- :mod:`hw_validate.rankwrap`    -- per-rank wrapper the launcher uses: tees logs, records exit status.
- :mod:`hw_validate.launch`      -- builds and supervises the launcher command (timeouts, dead ranks).

Calibration and validation:

- :mod:`hw_validate.microbench`  -- the microbenchmark job's entry point, run by every rank.
- :mod:`hw_validate.microbenchmarks` -- what that job measures, one module per kind; its spec and runner.
- :mod:`hw_validate.desync`      -- the reference job: a real job's per-call spans as a desync profile.
- :mod:`hw_validate.fits`        -- the fits, one module per thing fitted (links, compute, CPU ranks, ...).
- :mod:`hw_validate.calibrate_fit` -- a microbenchmark result to a Calibration, every fit in turn.
- :mod:`hw_validate.calibration_report` -- the human report of a calibration.
- :mod:`hw_validate.calibrate`   -- ``moesim calibrate``: measure, run the reference job, fit, write.
- :mod:`hw_validate.phases`      -- the job's phases on both sides: simulated from spans, measured.
- :mod:`hw_validate.validate`    -- ``moesim validate``: the real job against the simulator.

Only ``model``, ``timing``, ``router_trace``, ``upcycle``, ``data``, ``train_moe``, ``microbench`` and
the rank side of ``microbenchmarks`` import torch or deepspeed; ``launch``, ``measurement``,
``rankwrap``, ``dsconfig`` and the calibration and validation drivers stay light so the CLI can
import them on machines without the ``hw`` extra.
"""
