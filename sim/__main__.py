"""``python -m sim`` is the same as the ``moesim`` console script."""

from sim.cli.main import main

raise SystemExit(main())
