"""The conversion a framework plugin runs: ``lowprec.convert``, and a warning when it converted nothing.

``lowprec.convert`` warns about layers the recipe's GEMMs cannot take and layers too small to gain, but a
model whose linears the policy kept by name, or a model without any ``torch.nn.Linear``, converts nothing
in silence: the report says so, and a caller reads it. A framework plugin has no caller reading the report,
so it warns here instead; a run that would train wholly in high precision never looks like a low-precision
one.
"""
from __future__ import annotations

import warnings

from torch import nn

import lowprec
from lowprec import recipes as R
from lowprec.conversion_report import ConversionReport
from lowprec.policy import Policy

SHOWN_REASONS = 3
"""Kept layers named in the warning (the report lists them all)."""


class NothingConvertedWarning(UserWarning):
    """A low-precision recipe converted none of the model's linears: the model trains in high precision."""


def convert_checked(model: nn.Module, recipe: R.Recipe, policy: Policy | None, who: str) -> ConversionReport:
    """``lowprec.convert(model, recipe, policy)``; a :class:`NothingConvertedWarning` naming ``who`` (the
    plugin) when ``recipe`` casts to low precision but no layer was converted."""
    report = lowprec.convert(model, recipe, policy)
    if recipe.low_precision and not report.converted:
        warnings.warn(NothingConvertedWarning(f"lowprec: {who}: {recipe.name} converted none of the model's "
                                              f"linears, so it trains in high precision: {_why(report)}"),
                      stacklevel=3)
    return report


def _why(report: ConversionReport) -> str:
    """Why nothing was converted: no linear at all, or the first kept layers with their reasons."""
    if not report.layers:
        return "it has no torch.nn.Linear (see the conversion report)"
    shown = "; ".join(f"{lr.name}: {lr.reason}" for lr in report.kept[:SHOWN_REASONS])
    more = f" (and {len(report.kept) - SHOWN_REASONS} more)" if len(report.kept) > SHOWN_REASONS else ""
    return f"{len(report.kept)} kept in high precision: {shown}{more}"
