"""The operator's surface: the `tokenfleet` command (``main``, its parser ``build_parser``), every subcommand,
the one-machine launcher of `tokenfleet up` and its supervisor. Library packages never import it."""

from tokenfleet.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
