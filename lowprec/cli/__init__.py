"""Command-line interface: ``lowprec formats / train / compare / check / inspect / export / plan / info``."""
from lowprec.cli import (  # noqa: F401
    check_cmd,
    compare_cmd,
    export_cmd,
    formats_cmd,
    info_cmd,
    inspect_cmd,
    plan_cmd,
    train_cmd,
)
from lowprec.cli.app import main

__all__ = ["main"]
