"""A real tensor-parallel job on local CPU ranks against the simulator (issue 27 item 5).

::

    python -m hw_validate.tp_job SCEN --out DIR [--calibration C] [--steps N] [--warmup N]
        [--set k=v]... [--reuse] [--json P]

Runs the scenario (``parallelism.tp`` = the world size, with sequence parallelism unless
``parallelism.sequence_parallel: false``, CPU ranks on gloo) with
``torch.distributed.tensor.parallel`` (:mod:`hw_validate.layout.tp_rank`), simulates it with the
calibration and prints every layer's TP all-gather / reduce-scatter (or all-reduce) and GEMMs
measured against predicted (:mod:`hw_validate.layout.compare`); ``DIR/validation.json`` keeps it all.
"""

from __future__ import annotations

import sys

from hw_validate.layout.compare import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main("tensor_parallel", "python -m hw_validate.tp_job", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
