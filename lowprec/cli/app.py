"""The ``lowprec`` command group. Each subcommand lives in its own module and registers itself.

Bad input ends a command with one line and exit status 1, not a traceback: lowprec's own messages
(``"<argument>: expected <what>, got <what>"``, see :mod:`lowprec._checks`) as they are; running out
of memory with what to reduce; a ``ValueError``, ``TypeError``, ``KeyError`` or ``OSError`` from a
library below with its exception's name, so that a message such as ``'>' not supported ...`` at
least says what kind of failure it was. Other exceptions keep their traceback (a bug to report).

[Note: one error line under torchrun]
torchrun starts every rank with the same command line, so bad input fails on every rank alike (the
ranks agree on what only rank 0 sees, such as the run directory's lock). Rank 0 alone says it: the
other ranks print nothing and wait, at most :data:`OTHER_RANK_WAIT_S`, for torchrun to stop them,
which it does as soon as rank 0 has exited with status 1 (were they to exit first, torchrun could
stop rank 0 before its line is out). A rank still running after the wait failed alone (rank 0 went
on, or waits in a collective): it says its own error, naming its rank, and exits 1. What the user
sees after the line is torchrun's own report of the failed ranks, which lowprec cannot change.
"""
from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Iterator

import click
import torch

from lowprec._checks import fail

_OWN_MESSAGE = re.compile(r"^[\w./\-\[\]' ]+: expected .+, got ", re.DOTALL)
"""The shape of the messages lowprec's checks write (``_checks.fail``)."""
OTHER_RANK_WAIT_S = 20.0
"""How long a rank other than 0 waits, silent, for torchrun to stop it after bad input (see [Note: one
error line under torchrun]): rank 0 meets the same error moments later at most."""
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


def _said_once(e: click.ClickException) -> click.ClickException:
    """``e`` as this rank says it under torchrun (see [Note: one error line under torchrun]); as it is
    in one process and on rank 0."""
    from lowprec.distributed.launch import torchrun_rank  # DDP's imports: only when a command fails

    rank = torchrun_rank()
    if not rank:
        return e
    time.sleep(OTHER_RANK_WAIT_S)  # torchrun stops this rank here once rank 0 has said the same error
    return click.ClickException(f"rank {rank}: {e.format_message()}")


@contextlib.contextmanager
def one_line_warnings(show: bool = True) -> Iterator[None]:
    """Warnings (e.g. "GEMMs are emulated on cpu") as one ``warning: ...`` line each, without source lines;
    none at all without ``show`` (ranks other than 0, whose warnings rank 0 gives too)."""
    with warnings.catch_warnings():  # restores the default display on exit
        if show:
            warnings.showwarning = lambda message, *_args, **_kw: click.echo(f"warning: {message}", err=True)
        else:
            warnings.simplefilter("ignore")
        yield


class _Group(click.Group):
    """Turns bad input (and running out of memory) into a one-line message and exit code 1, not a traceback;
    under torchrun from rank 0 alone. Every command's warnings are one line each (:func:`one_line_warnings`)."""

    def invoke(self, ctx: click.Context):
        try:
            with one_line_warnings():
                return super().invoke(ctx)
        except click.ClickException as e:
            raise _said_once(e) from None
        except Exception as e:
            # other errors (a bug, most likely) keep their traceback
            if isinstance(e, (ValueError, TypeError, KeyError, OSError)) or _out_of_memory(e):
                raise _said_once(click.ClickException(one_line(e))) from e
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
