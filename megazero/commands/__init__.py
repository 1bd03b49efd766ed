"""Subcommands of the ``megazero`` command line, one module each."""
