"""The weights ``convert`` cannot see into: matrices a model multiplies tokens by that are not linears.

[Note: weights lowprec cannot see into]
``convert`` swaps ``nn.Linear`` modules. A matrix used any other way runs in the model's precision
whatever the recipe: the fused expert weights Hugging Face keeps as 3-D parameters on an experts
module (Mixtral's ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], applied with ``bmm`` or a
grouped GEMM), or the ``weight`` [out, in] of a module of its own applied with ``F.linear``. In a
mixture of experts they hold most of the parameters, so a conversion that passed over them in
silence would have a verdict on the recipe rest on a model that mostly never ran it. They are named
instead (the report's table, notes and JSON, and one warning), and the coverage counts their
parameters as not converted.

Which parameters are named, conservatively, from what the module is and the parameter's shape alone
(nothing runs):
* none of a module the report already has: every ``nn.Linear`` (converted or kept) and what the
  policy keeps whole (``nn.MultiheadAttention``), nor of a ``lowprec.nn.GroupedLinear`` (``convert``
  binds the recipe to it and gives it a row; outside ``convert``, one bound to a recipe of its own);
* none the report has as a parameter: the weights of the Hugging Face experts ``convert`` runs through
  ``GroupedLinear`` (their module is replaced, the parameters stay; ``lowprec.convert_hf_moe``);
* none of a module that holds no token matrix: embeddings (``nn.Embedding``, or a type whose name
  says ``Embed``), norms (a type whose name says ``Norm``) and convolutions, nor a parameter such a
  module shares (a tied head);
* of any other module, a parameter with three or more dimensions over 1 (a stack of matrices), and
  one with two whose name does not say it is an embedding, a position table, a norm, a bias, a
  scale or a log (``pos_embed``, ``A_log``). Vectors are biases and gains, never named.
"""
from __future__ import annotations

import re
import warnings

import torch.nn as nn

from lowprec.conversion_report import Coverage, UnseenWeight
from lowprec.nn import GroupedLinear

__all__ = ["UnseenWeightsWarning", "find_unseen", "warn_unseen"]

_NOT_A_MATRIX = re.compile(r"emb|pos|norm|bias|scale|table|token|cls|(^|_)log($|_)", re.IGNORECASE)
"""Names of 2-D parameters that are not matrices multiplied by tokens."""


class UnseenWeightsWarning(UserWarning):
    """The one warning ``convert`` gives for the weights it cannot see into, with them, so that a
    command can say it in its own words."""

    def __init__(self, message: str, unseen: tuple[UnseenWeight, ...]) -> None:
        super().__init__(message)
        self.unseen = unseen


_NO_TOKEN_MATRIX = re.compile(r"Norm($|[A-Z_\d])|Embed(ding)?s?($|[A-Z_\d])")
"""Types of norms and embeddings (``LlamaRMSNorm``, ``BatchNorm1d``, ``PatchEmbed``, ``BertEmbeddings``),
not of a model named after one (``NormalizedTransformer``)."""


def _holds_no_token_matrix(m: nn.Module) -> bool:
    return (isinstance(m, (nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd))
            or _NO_TOKEN_MATRIX.search(type(m).__name__) is not None)


def _is_matrix(leaf: str, shape: tuple[int, ...]) -> bool:
    dims = sum(d > 1 for d in shape)
    return dims >= 3 or (dims == 2 and len(shape) >= 2 and not _NOT_A_MATRIX.search(leaf))


def find_unseen(model: nn.Module, reported: set[int]) -> list[UnseenWeight]:
    """The matrices of ``model`` that lowprec cannot see into (see [Note: weights lowprec cannot see
    into]), in the order of ``named_modules``; ``reported``: ids of the modules the report has, whole, and
    of the parameters it has."""
    known = [m for m in model.modules() if id(m) in reported or isinstance(m, nn.Linear) or _holds_no_token_matrix(m)
             or (isinstance(m, GroupedLinear) and m.recipe is not None)]
    seen = {id(p) for m in known for p in m.parameters(recurse=False)} | reported  # with the children
    known_ids = {id(m) for m in known}
    out = []
    for name, m in model.named_modules():
        if id(m) in known_ids:
            continue
        for leaf, p in m.named_parameters(recurse=False):
            shape = tuple(p.shape)
            if id(p) not in seen and _is_matrix(leaf, shape):
                seen.add(id(p))
                out.append(UnseenWeight(f"{name}.{leaf}" if name else leaf, shape, type(m).__name__, p.numel()))
    return out


def warn_unseen(unseen: list[UnseenWeight], coverage: Coverage, stacklevel: int) -> None:
    """One warning naming the first five and saying how much of the matrix parameters they hold."""
    if not unseen:
        return
    names = ", ".join(u.name for u in unseen[:5]) + (" ..." if len(unseen) > 5 else "")
    share = coverage.unseen_params / coverage.params
    warnings.warn(UnseenWeightsWarning(
        f"lowprec: {len(unseen)} weight(s) holding {share:.0%} of the matrix parameters are not converted: lowprec "
        f"cannot see into them (fused 3-D experts, modules it does not know), so they run in the model's precision: "
        f"{names} (see the conversion report)", tuple(unseen)), stacklevel=stacklevel + 1)
