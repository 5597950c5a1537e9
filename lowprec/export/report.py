"""What an export wrote, layer by layer: the report ``lowprec.export`` returns, the CLI prints and the out
directory keeps as ``export_report.json``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from lowprec._table import format_table
from lowprec.export.layout import AS_TRAINED, FROM_MASTER

KEPT = "kept"
"""How a layer was written when the export kept it in high precision (beside ``layout.AS_TRAINED`` and
``layout.FROM_MASTER``)."""
REPORT_FILE = "export_report.json"


@dataclass(frozen=True, slots=True)
class LayerExport:
    """One linear of the exported model."""

    name: str
    """The module's name in the exported model (``model.layers.0.self_attn.q_proj``)."""
    source: str
    """The module's name in the lowprec model (``layers.0.attention.wq``)."""
    shape: tuple[int, ...]
    """The weight's shape, ``(out, in)``."""
    written: str
    """What the weight was written as (``bf16``, ``fp8 e4m3 128x128``, ...)."""
    how: str
    """``as trained``, ``from the FP32 master`` or ``kept``."""
    reason: str = ""
    """Why a layer was kept, or a note on how it was made."""


@dataclass(slots=True)
class ExportReport:
    """What :func:`lowprec.export` wrote: the format, the directory, each linear and how it was made."""

    format: str
    scheme: str | None
    out_dir: str
    architecture: str
    """The Hugging Face architecture written (``LlamaForCausalLM``)."""
    recipe: str | None
    """The training recipe whose quantized weights the export could take, or None."""
    layers: list[LayerExport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the reader should know that no row says (a guess about the training device, a tied head)."""
    files: list[str] = field(default_factory=list)

    def count(self, how: str) -> int:
        return sum(r.how == how for r in self.layers)

    @property
    def kept(self) -> list[str]:
        return [r.name for r in self.layers if r.how == KEPT]

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(h)} {h}" for h in _HOWS if self.count(h))
        scheme = f" --scheme {self.scheme}" if self.scheme else ""
        return (f"{self.out_dir}: {self.architecture}, format {self.format}{scheme}, {len(self.layers)} linears "
                f"({counts})")

    def table(self) -> str:
        rows = [(r.name, "x".join(map(str, r.shape)), r.written, r.how, r.reason) for r in self.layers]
        return format_table(["layer", "shape", "written as", "how", "why"], rows)

    def __str__(self) -> str:
        return "\n".join([self.summary(), self.table(), *(f"note: {n}" for n in self.notes)])

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = [{**asdict(r), "shape": list(r.shape)} for r in self.layers]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


_HOWS = (AS_TRAINED, FROM_MASTER, KEPT)
