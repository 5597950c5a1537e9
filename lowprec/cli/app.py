"""The ``lowprec`` command group. Each subcommand lives in its own module and registers itself."""
from __future__ import annotations

import click


class _Group(click.Group):
    """Turns lowprec's argument errors into a one-line message and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (ValueError, TypeError, FileNotFoundError, KeyError, OSError) as e:
            if isinstance(e, click.ClickException):
                raise
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise click.ClickException(msg) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowprec")
def main() -> None:
    """Train language models in FP8, MX and NVFP4, and check they match BF16."""
