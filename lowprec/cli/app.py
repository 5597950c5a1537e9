"""The ``lowprec`` command group. Each subcommand lives in its own module and registers itself.

Bad input ends a command with one line and exit status 1, not a traceback: lowprec's own messages
(``"<argument>: expected <what>, got <what>"``, see :mod:`lowprec._checks`) as they are; running out
of memory with what to reduce; a ``ValueError``, ``TypeError``, ``KeyError`` or ``OSError`` from a
library below with its exception's name, so that a message such as ``'>' not supported ...`` at
least says what kind of failure it was. Other exceptions keep their traceback (a bug to report).
"""
from __future__ import annotations

import re

import click
import torch

from lowprec._checks import fail

_OWN_MESSAGE = re.compile(r"^[\w./\-\[\]' ]+: expected .+, got ", re.DOTALL)
"""The shape of the messages lowprec's checks write (``_checks.fail``)."""
OUT_OF_MEMORY_HINT = ("reduce --batch-size or --seq-len (raise --grad-accum to keep the tokens per step), or "
                      "train a smaller --model")


def _out_of_memory(e: BaseException) -> bool:
    # the CPU allocator reports an allocation it cannot make as a plain RuntimeError
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def one_line(e: BaseException) -> str:
    """The one-line message for an error that ends a command."""
    if _out_of_memory(e):
        # torch's first two sentences say where and how much ("CUDA out of memory. Tried to allocate 2 GiB");
        # the rest is allocator advice that would not fit on a line
        what = ". ".join(" ".join(str(e).split()).split(". ")[:2]).rstrip(".") or type(e).__name__
        return f"out of memory ({what}): {OUT_OF_MEMORY_HINT}"
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    msg = " ".join(str(msg).split())  # one line, whatever the library below wrote
    if isinstance(e, click.ClickException) or _OWN_MESSAGE.match(msg):
        return msg
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class _Group(click.Group):
    """Turns bad input (and running out of memory) into a one-line message and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except Exception as e:
            # other errors (a bug, most likely) keep their traceback
            if isinstance(e, (ValueError, TypeError, KeyError, OSError)) or _out_of_memory(e):
                raise click.ClickException(one_line(e)) from e
            raise


def check_device(device: str | None) -> None:
    """``device`` (``--device``; None: the default) must be one this machine has, so that a run on a
    machine without CUDA stops here in one line rather than deep inside torch."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except RuntimeError:
        fail("device", "a torch device such as 'cpu' or 'cuda:0'", repr(device))
    if d.type == "cpu" or d.type == "meta":
        return
    backend = getattr(torch, d.type, None)
    if backend is None or not hasattr(backend, "is_available"):
        return  # a device type torch gives no way to ask about: torch says what it thinks when used
    if not backend.is_available():
        why = (f"torch {torch.__version__} is built without CUDA" if d.type == "cuda" and torch.version.cuda is None
               else f"no {d.type} device is visible")
        fail("device", "cpu or a device this machine has", f"{device!r} ({why})")
    count = backend.device_count() if hasattr(backend, "device_count") else None
    if d.index is not None and count is not None and d.index >= count:
        have = ", ".join(f"{d.type}:{i}" for i in range(count))
        fail("device", f"one of cpu, {have}", repr(device))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowprec")
def main() -> None:
    """Train language models in FP8, MX and NVFP4, and check they match BF16."""
