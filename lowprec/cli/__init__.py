"""Command-line interface: ``lowprec formats / train / compare / plan / info``."""
from lowprec.cli.app import main
from lowprec.cli import formats_cmd  # noqa: F401  (registers the command)

__all__ = ["main"]
