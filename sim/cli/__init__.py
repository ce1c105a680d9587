"""The ``moesim`` command line: one module per subcommand, each with ``add_arguments`` and ``run``."""
