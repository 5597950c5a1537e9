"""Command-line interface: ``lowprec formats / train / compare / plan / info``."""
from lowprec.cli.app import main
from lowprec.cli import formats_cmd  # noqa: F401  (registers the command)
from lowprec.cli import plan_cmd  # noqa: F401
from lowprec.cli import info_cmd  # noqa: F401
from lowprec.cli import train_cmd, compare_cmd  # noqa: F401

__all__ = ["main"]
