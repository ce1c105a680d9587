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

Only ``model``, ``timing``, ``router_trace``, ``upcycle``, ``data`` and ``train_moe`` import torch or
deepspeed; ``launch``, ``measurement``, ``rankwrap`` and ``dsconfig`` stay light so the CLI can
import them on machines without the ``hw`` extra.
"""
