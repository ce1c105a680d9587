"""A real pipeline-parallel job on local CPU ranks against the simulator (issue 27 item 5).

::

    python -m hw_validate.pipeline_job SCEN --out DIR [--calibration C] [--steps N] [--warmup N]
        [--set k=v]... [--reuse] [--json P]

Runs the scenario (``parallelism.pp`` stages, ``vpp`` chunks each, tp = cp = dp = 1, CPU ranks on
gloo) as ``torch.distributed.pipelining``'s 1F1B or interleaved 1F1B
(:mod:`hw_validate.layout.pipeline_rank`), simulates it with the calibration and prints the
pipeline bubble, the p2p sends and every pass measured against predicted
(:mod:`hw_validate.layout.compare`); ``DIR/validation.json`` keeps it all.
"""

from __future__ import annotations

import sys

from hw_validate.layout.compare import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main("pipeline", "python -m hw_validate.pipeline_job", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
