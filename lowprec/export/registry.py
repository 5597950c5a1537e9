"""Which export formats exist, and the layout for a format and scheme.

[Note: the format registry]
Each format lives in a module of this package exposing ``LAYOUTS``: a mapping from ``(format, scheme)`` to a
factory taking no argument that returns a :class:`~lowprec.export.layout.Layout` (``scheme`` None for a format
without schemes; a plain format name stands for ``(name, None)``). The modules are imported by name when a
format is asked for, so a module that is not there (or not yet) lists nothing, and one that fails to import
for another reason says so.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

from lowprec._checks import fail
from lowprec.export.layout import Layout

MODULES = ("hf", "fp8", "compressed", "modelopt", "gptoss")
"""The modules of this package that hold formats, in the order ``formats()`` lists them."""

Key = tuple[str, "str | None"]


def _module_layouts(module: str) -> dict[Key, Callable[[], Layout]]:
    try:
        mod = importlib.import_module(f"lowprec.export.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"lowprec.export.{module}":
            return {}  # the format is not built (yet)
        raise
    return {(k, None) if isinstance(k, str) else tuple(k): f for k, f in getattr(mod, "LAYOUTS", {}).items()}


def layouts() -> dict[Key, Callable[[], Layout]]:
    """Every ``(format, scheme)`` a module of :data:`MODULES` provides (see [Note: the format registry])."""
    out: dict[Key, Callable[[], Layout]] = {}
    for module in MODULES:
        out.update(_module_layouts(module))
    return out


def formats() -> dict[str, tuple[str, ...]]:
    """Each format by name, with the schemes it takes (none for a format without schemes)."""
    out: dict[str, list[str]] = {}
    for fmt, scheme in layouts():
        out.setdefault(fmt, [])
        if scheme is not None:
            out[fmt].append(scheme)
    return {f: tuple(s) for f, s in out.items()}


def get_layout(format: str, scheme: str | None = None, **options) -> Layout:
    """The layout of ``format`` in ``scheme``; an unknown format or scheme, a scheme given to a format without
    schemes or none to one that needs one, is refused naming the argument. ``options`` go to the layout's
    factory (``input_amax=`` for a layout that ``calibrates``)."""
    table = layouts()
    known = formats()
    if format not in known:
        fail("format", "one of " + ", ".join(known), repr(format))
    schemes = known[format]
    if scheme is not None and not schemes:
        fail("scheme", f"no scheme for format {format!r} (schemes are for: "
             f"{', '.join(f for f, s in known.items() if s) or 'no format here'})", repr(scheme))
    if (format, scheme) not in table:
        fail("scheme", f"one of {', '.join(schemes)} for format {format!r}", repr(scheme) if scheme else "none")
    return table[(format, scheme)](**options)
