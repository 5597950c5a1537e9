"""A conversion policy as a JSON file: what ``lowprec train --policy`` and ``lowprec compare --policy``
read, and what ``lowprec check`` and ``lowprec inspect`` write.

The file holds the fields of :class:`lowprec.policy.Policy` that are data (a predicate cannot be
written down: ``include``/``exclude`` are lists of glob patterns here)::

    {"format": "lowprec-policy", "version": 1,
     "policy": {"exclude": ["layers.0.*", "*.w2"], "skip_small": false, "saved_activations": "1x128"}}

Fields left out take :class:`Policy`'s defaults. An unknown field, a wrong type or a file that is not
such a JSON object is refused with the field's name, never ignored: a misspelt ``exlcude`` would
otherwise convert the layers the user meant to keep.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from lowprec._checks import describe, fail
from lowprec._files import check_writable, with_default_mode
from lowprec.nn.saved import SavedActivations, fp8_activations
from lowprec.policy import Policy

FORMAT = "lowprec-policy"
VERSION = 1
_FIELDS = tuple(f.name for f in fields(Policy))
CONVERT_SMALL = json.dumps({"format": FORMAT, "version": VERSION, "policy": {"skip_small": False}})
"""The whole policy file that converts the layers kept as too small to gain: what every message naming that
option quotes, so a user can paste it as it is."""


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The fields of ``policy`` that differ from the defaults, as JSON values (tuples become lists)."""
    if not isinstance(policy, Policy):
        fail("policy", "a lowprec.Policy", describe(policy), TypeError)
    default = Policy()
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(policy, name)
        if callable(value):
            fail(f"policy.{name}", "glob patterns (a predicate cannot be written to a file)", describe(value))
        if value == getattr(default, name):
            continue
        if name == "share_inputs":
            value = [list(g) for g in value]
        elif name == "saved_activations":
            value = _saved_spec(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def _saved_spec(saved: SavedActivations) -> str:
    """``saved_activations`` as ``--fp8-activations`` writes it: ``"tensor"`` or ``"1xB"``."""
    g = saved.granularity
    for spec in ("tensor", f"1x{g.block_cols}"):
        if g.block_cols is not None or spec == "tensor":
            try:
                if fp8_activations(spec) == saved:
                    return spec
            except ValueError:
                pass
    fail("policy.saved_activations", "E4M3 per tensor or per 1xB block (what a policy file can hold)", str(saved))


def policy_from_dict(data: Any, where: str = "policy") -> Policy:
    """A :class:`Policy` from :func:`policy_to_dict`'s form; ``where`` names the source in errors."""
    if not isinstance(data, dict):
        fail(where, "a JSON object of Policy fields", describe(data))
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        fail(where, "fields among " + ", ".join(_FIELDS), "unknown field(s) " + ", ".join(map(repr, unknown)))
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name in ("include", "exclude") and value is not None:
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                fail(f"{where}.{name}", "a list of glob patterns or null", describe(value))
            value = tuple(value)
        elif name == "saved_activations" and value is not None:
            value = fp8_activations(value) if isinstance(value, str) else \
                fail(f"{where}.{name}", "null, 'tensor' or '1xB' such as '1x128'", describe(value))
        elif name == "share_inputs":
            if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
                fail(f"{where}.{name}", "a list of lists of layer names", describe(value))
            value = tuple(tuple(g) for g in value)
        kwargs[name] = value
    try:
        return Policy(**kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def save_policy(policy: Policy, path: str | Path) -> Path:
    """Write ``policy`` to ``path`` atomically (a reader never sees half a file)."""
    path = check_writable("path", path, directory=False)
    text = json.dumps({"format": FORMAT, "version": VERSION, "policy": policy_to_dict(policy)}, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with_default_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_policy(path: str | Path) -> Policy:
    """The policy in ``path`` (see the module's docstring for the form)."""
    data = read_policy_dict(path)
    return policy_from_dict(data, f"policy file {str(path)!r}")


def read_policy_dict(path: str | Path) -> dict[str, Any]:
    """The ``policy`` object of a policy file, checked to be one (its fields are checked by
    :func:`policy_from_dict`)."""
    p = Path(path)
    if not p.is_file():
        fail("policy", "a policy JSON file", f"{str(path)!r}, which is not a file")
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail("policy", "a policy JSON file", f"{str(path)!r}, which is not valid JSON ({e})")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        fail("policy", f'a JSON object with "format": "{FORMAT}"', f"{str(path)!r} holding {describe(doc)}")
    if doc.get("version") != VERSION:
        fail("policy", f"version {VERSION} of the policy file", f"version {doc.get('version')!r} in {str(path)!r}")
    return doc.get("policy", {})
