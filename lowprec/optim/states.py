"""AdamW's moments stored in fewer bits: FP32, BF16, FP8 with range expansion, or blockwise 8-bit.

[Note: FP8 moments with dynamic range expansion]
The values of a moment within a group of 128 span far less than E4M3's range, so a plain per-group
scale leaves most of E4M3's exponents unused and every value gets E4M3's relative error (2^-4).
COAT (arXiv 2410.19313) expands each group with a power function before the cast: with ``a`` the
group's largest magnitude and ``R = a / b`` its dynamic range (``b`` the smallest nonzero magnitude),
the normalised values ``|x| / a`` in ``[1/R, 1]`` are raised to ``k = log(R_E4M3) / log(R)``, which
maps them onto ``[1/R_E4M3, 1]``, and multiplied by 448, E4M3's largest value. Decoding inverts it:
``x = sign * a * (|code| / 448) ^ (1 / k)``. A relative error ``d`` of the code becomes ``d / k`` of
``x``, so the narrower a group's range, the more precise its values. We take ``R_E4M3`` between
E4M3's smallest *normal* value and its largest (448 / 2^-6 = 2^15 * 7/8), so every nonzero value of a
group lands on a normal code (full precision), never on a subnormal and never on zero. ``k`` is kept
in ``[K_MIN, K_MAX]``: below, a group holding one tiny value would lose the precision of all others;
above, only groups of nearly equal magnitudes, which need no expansion. Each group stores ``a`` and
``k`` (float32): 1 + 8/128 bytes per value. Normalising before the power keeps it in float32's range
(the moments' own magnitudes, ~1e-10 for the second, would underflow raised to k).

[Note: blockwise 8-bit moments]
As 8-bit Adam (arXiv 2110.02861) does, a block of 2048 values shares one float32 absmax. The first
moment is stored linearly in int8 (``round(127 x / a)``). The second is non-negative and its small
values matter most (AdamW divides by their square root), so its *square root* is stored linearly in
uint8 (``round(255 sqrt(v) / sqrt(a))``), and a nonzero value never gets code 0: a second moment
rounded to zero would divide the first moment by ``eps`` alone and throw its weight far off. Its
floor, code 1, over-estimates such values, which only shrinks their updates. 1 + 4/2048 bytes per
value.

[Note: where the states live]
Each moment keeps the parameter's shape (codes of the same shape as the parameter) plus, for FP8 and
8-bit, one float32 per group of the flattened parameter (the last group may be partial): the state
keys are ``exp_avg`` / ``exp_avg_sq`` and, per group, ``<key>_scale`` and (FP8) ``<key>_expansion``.
The float32 working copies made at a step exist for one parameter at a time.

[Note: moments of FSDP2 shards]
FSDP2 splits each parameter along dim 0 across ranks (uneven splits included) and a distributed checkpoint
may be loaded on another number of ranks. A group that straddled two ranks' rows could be neither encoded
on one rank nor resharded, so for FSDP2 parameters of two or more dimensions the groups lie inside rows
(``store(..., rows=True)``): each row of dim 0 flattened and cut into groups, its last one partial, the
per-group tensors shaped ``(rows, groups per row)`` and sharded along their rows as the parameter is. Where
a row's length is a multiple of the group, these are the same groups as the flattened layout's. One-
dimensional parameters have rows of one value, groups of one: :class:`lowprec.optim.AdamWLP` keeps BF16
moments for them under FSDP2, and says so.
"""
from __future__ import annotations

import enum
import math

import torch

from lowprec import formats
from lowprec._checks import Choice

E4M3_MAX = 448.0
"""E4M3's largest finite value."""
E4M3_RANGE = E4M3_MAX / 2.0**-6
"""E4M3's dynamic range from its smallest normal value to its largest (see [Note: FP8 moments ...])."""
K_MIN = 0.25
"""The least expansion exponent: a group's range may be compressed at most this much."""
K_MAX = 16.0
"""The greatest expansion exponent."""
FP8_GROUP = 128
"""Values per FP8 group (one absmax and one exponent each)."""
INT8_BLOCK = 2048
"""Values per 8-bit block (one absmax each)."""
_INT8_LEVELS = 127.0
_UINT8_LEVELS = 255.0
INV_INT8_LEVELS = 1 / _INT8_LEVELS
"""Rounded to float32 where it multiplies (torch's and Triton's float32 ops both round a Python float so)."""
INV_UINT8_LEVELS = 1 / _UINT8_LEVELS


class StateFormat(Choice):
    """How each moment is stored between steps."""

    FP32 = "fp32"
    BF16 = "bf16"
    """Rounded to nearest BF16."""
    FP8 = "fp8"
    """E4M3 per group of 128, with dynamic range expansion (see [Note: FP8 moments ...])."""
    INT8 = "int8"
    """8 bits per block of 2048 (see [Note: blockwise 8-bit moments])."""

    @classmethod
    def parse(cls, value: str | StateFormat, name: str = "optim_states") -> StateFormat:
        return super().parse(value, name)

    @property
    def group(self) -> int | None:
        """Values sharing one set of per-group scales; None without them."""
        return {StateFormat.FP8: FP8_GROUP, StateFormat.INT8: INT8_BLOCK}.get(self)

    @property
    def group_keys(self) -> tuple[str, ...]:
        """Suffixes of the per-group float32 tensors each moment keeps."""
        return {StateFormat.FP8: ("_scale", "_expansion"), StateFormat.INT8: ("_scale",)}.get(self, ())

    @property
    def bytes_per_value(self) -> float:
        """Bytes per parameter of one moment, the per-group float32s spread over full groups."""
        code = {StateFormat.FP32: 4, StateFormat.BF16: 2}.get(self, 1)
        return code + (4 * len(self.group_keys) / self.group if self.group else 0.0)


class Moment(enum.Enum):
    """AdamW's two moments, by their state key (torch's names)."""

    FIRST = "exp_avg"
    SECOND = "exp_avg_sq"


PER_GROUP_KEYS = frozenset(m.value + s for m in Moment for s in ("_scale", "_expansion"))
"""State keys holding one float32 per group, not one value per element of the parameter."""


def state_bytes(numel: int, fmt: StateFormat) -> int:
    """Bytes one moment of a ``numel``-element parameter takes in ``fmt``, its partial last group included."""
    if fmt.group is None:
        return numel * int(fmt.bytes_per_value)
    return numel + 4 * len(fmt.group_keys) * math.ceil(numel / fmt.group)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """float32 square roots correctly rounded on every device (torch's CPU kernel may miss by an ulp): taken
    in float64 and rounded once more, which for a square root gives the correctly rounded float32."""
    return x.double().sqrt_().float()


def fp8_expansion(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's absmax ``a`` and expansion exponent ``k`` (see [Note: FP8 moments ...])."""
    mag = groups.abs()  # (groups, size)
    a = mag.amax(dim=1)
    b = torch.where(mag > 0, mag, torch.inf).amin(dim=1)
    log_range = torch.log(a / b)  # 0 for groups of one magnitude, nan for all-zero groups
    k = (math.log(E4M3_RANGE) / log_range).nan_to_num(nan=1.0, posinf=K_MAX).clamp(K_MIN, K_MAX)
    return a, k


def fp8_encode(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 E4M3 codes of the expanded groups, with each group's absmax and exponent."""
    a, k = fp8_expansion(groups)
    unit = groups.abs() / torch.where(a > 0, a, 1.0)[:, None]  # in [0, 1]
    expanded = torch.copysign(unit.pow(k[:, None]) * E4M3_MAX, groups)
    return formats.encode(expanded, "e4m3"), a, k


def fp8_decode(codes: torch.Tensor, a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The float32 groups that :func:`fp8_encode` encoded."""
    y = formats.decode_unchecked(codes, "e4m3")  # (groups, size)
    return torch.copysign((y.abs() / E4M3_MAX).pow((1.0 / k)[:, None]) * a[:, None], y)


def int8_encode(groups: torch.Tensor, moment: Moment) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes of each block and its absmax (see [Note: blockwise 8-bit moments])."""
    a = groups.abs().amax(dim=1)
    safe = torch.where(a > 0, a, 1.0)[:, None]
    if moment is Moment.FIRST:
        return torch.round(groups / safe * _INT8_LEVELS).to(torch.int8), a
    q = torch.round(sqrt_rn(groups / safe) * _UINT8_LEVELS)
    return torch.where(groups > 0, q.clamp_min(1.0), q).to(torch.uint8), a


def int8_decode(codes: torch.Tensor, a: torch.Tensor, moment: Moment) -> torch.Tensor:
    """The float32 blocks of 8-bit codes: products by the float32 reciprocals of 127 and 255, which every
    device rounds alike (CUDA turns a division by a Python number into that product, the CPU does not)."""
    if moment is Moment.FIRST:
        return codes.float() * (a[:, None] * INV_INT8_LEVELS)
    return (codes.float() * INV_UINT8_LEVELS).square() * a[:, None]


def _rows(shape: tuple[int, ...], rows: bool) -> tuple[int, int]:
    """(rows, values per row) of a moment's groups: the flattened moment as one row, or dim 0's rows."""
    return (shape[0], math.prod(shape[1:])) if rows else (1, math.prod(shape))


def row_groups(shape: tuple[int, ...], fmt: StateFormat) -> tuple[int, int]:
    """The shape of each per-group tensor of a moment of ``shape`` stored with ``rows``."""
    return shape[0], math.ceil(math.prod(shape[1:]) / fmt.group)


def _row_groups(x: torch.Tensor, rows: int, row: int, size: int) -> torch.Tensor:
    """``x`` as ``rows`` rows of ``row`` values, each zero-padded into groups of ``size``: no group holds values
    of two rows (see [Note: moments of FSDP2 shards])."""
    return torch.nn.functional.pad(x.reshape(rows, row), (0, -row % size)).reshape(-1, size)


def store(x: torch.Tensor, fmt: StateFormat, moment: Moment, *, rows: bool = False) -> dict[str, torch.Tensor]:
    """The state entries holding the float32 moment ``x`` in ``fmt``: groups of the flattened ``x``, or with
    ``rows`` groups inside each row of ``x`` (its per-group tensors shaped ``(rows, groups per row)``)."""
    key = moment.value
    if fmt is StateFormat.FP32:
        return {key: x.float()}
    if fmt is StateFormat.BF16:
        return {key: x.to(torch.bfloat16)}
    r, n = _rows(tuple(x.shape), rows)
    groups = _row_groups(x.float(), r, n, fmt.group)
    if fmt is StateFormat.FP8:
        codes, a, k = fp8_encode(groups)
        extra = {"_scale": a, "_expansion": k}
    else:
        codes, a = int8_encode(groups, moment)
        extra = {"_scale": a}
    g = -(-n // fmt.group)  # groups per row
    per_group = (r, g) if rows else (g,)
    return {key: codes.reshape(r, g * fmt.group)[:, :n].reshape(x.shape),
            **{key + s: v.reshape(per_group) for s, v in extra.items()}}


def load(state: dict[str, torch.Tensor], fmt: StateFormat, moment: Moment, *, rows: bool = False) -> torch.Tensor:
    """The float32 moment that :func:`store` stored in ``state`` (with the same ``rows``)."""
    key = moment.value
    codes = state[key]
    if fmt.group is None:
        return codes.float()
    r, n = _rows(tuple(codes.shape), rows)
    groups = _row_groups(codes, r, n, fmt.group)
    if fmt is StateFormat.FP8:
        x = fp8_decode(groups, state[key + "_scale"].reshape(-1), state[key + "_expansion"].reshape(-1))
    else:
        x = int8_decode(groups, state[key + "_scale"].reshape(-1), moment)
    return x.reshape(r, -(-n // fmt.group) * fmt.group)[:, :n].reshape(codes.shape)


def code_dtype(fmt: StateFormat, moment: Moment) -> torch.dtype:
    """The dtype of a moment's codes (the tensor shaped like the parameter)."""
    if fmt is StateFormat.INT8:
        return torch.int8 if moment is Moment.FIRST else torch.uint8
    return {StateFormat.FP32: torch.float32, StateFormat.BF16: torch.bfloat16}.get(fmt, torch.uint8)
