"""Documents from a Hugging Face dataset: ``hf:PATH[:SPLIT]`` for one saved by ``save_to_disk``, or
``hf:NAME[:CONFIG][:SPLIT]`` for one on the Hub, streamed.

``hf:`` followed by an existing directory is a saved dataset (a ``Dataset``, or a ``DatasetDict`` whose
split follows a last ``:``, ``train`` by default); anything else is a Hub name, whose config and split
follow ``:`` (``hf:NAME::SPLIT`` gives a split without a config; the split is ``train`` by default).
A Hub dataset is streamed, so nothing but its tokens is kept, and needs the Hub: offline
(``HF_HUB_OFFLINE=1``) it is refused. A saved dataset is identified by its fingerprint and its files';
a streamed one by its name, config, split and the Hub revision it was read at.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec._checks import fail
from lowprec.train.fingerprint import file_fingerprint

HF_PREFIX = "hf:"
DEFAULT_SPLIT = "train"
_FORMS = "hf:PATH[:SPLIT] (a dataset saved by save_to_disk) or hf:NAME[:CONFIG][:SPLIT] (on the Hub)"
_BATCH_ROWS = 1024


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                              or (path / "dataset_dict.json").is_file())


@dataclass(frozen=True, slots=True)
class HFSource:
    """The documents of one split of a Hugging Face dataset: its ``text_field`` column, row by row."""

    label: str
    """As the user gave it (``hf:...``, or a saved dataset's directory)."""
    dataset: Any = field(repr=False)
    """A ``datasets.Dataset`` (saved) or ``datasets.IterableDataset`` (streamed)."""
    identity: dict[str, Any]
    cache_home: Path | None
    """A saved dataset's directory; None for a streamed one (the user's cache directory)."""
    text_field: str

    @property
    def description(self) -> str:
        split = self.identity.get("split")
        return (f"hf: {self.label.removeprefix(HF_PREFIX)} ({f'split {split!r}, ' if split else ''}"
                f"field {self.text_field!r})")

    def documents(self) -> Iterator[str]:
        for batch in self.dataset.select_columns([self.text_field]).iter(batch_size=_BATCH_ROWS):
            for value in batch[self.text_field]:
                if not isinstance(value, str):
                    fail("text_field", f"a string in column {self.text_field!r} of every row",
                         f"{self.label}: {value!r:.200}")
                yield value


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        fail("data", "the datasets package for hf: data (pip install 'lowprec[data]')", "it is not installed",
             ImportError)
    return datasets


def hf_source(spec: str | Path, text_field: str) -> HFSource:
    """The source ``spec`` names: ``hf:...`` (see the module), or the directory of a saved dataset."""
    if isinstance(spec, Path) or not str(spec).startswith(HF_PREFIX):
        return _saved(Path(spec), None, str(spec), text_field)
    rest = str(spec)[len(HF_PREFIX):]
    head, _, tail = rest.rpartition(":")
    if rest and Path(rest).expanduser().is_dir():
        return _saved(Path(rest).expanduser(), None, str(spec), text_field)
    if head and Path(head).expanduser().is_dir():
        return _saved(Path(head).expanduser(), tail or None, str(spec), text_field)
    if not rest or rest.startswith(("/", ".", "~")) or rest.count(":") > 2:
        fail("data", _FORMS, f"{str(spec)!r}" + (", which names no directory" if rest else ""))
    name, config, split = [*rest.split(":"), "", ""][:3]
    return _streamed(name, config or None, split or DEFAULT_SPLIT, str(spec), text_field)


def _saved(path: Path, split: str | None, label: str, text_field: str) -> HFSource:
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        fail("data", f"a directory saved by save_to_disk after hf: ({_FORMS})", f"{str(path)!r}: {e}")
    if isinstance(loaded, datasets.DatasetDict):
        split = split or DEFAULT_SPLIT
        if split not in loaded:
            fail("data", f"a split of the saved dataset ({', '.join(map(repr, loaded))})", f"{split!r} in {label!r}")
        loaded = loaded[split]
    elif split is not None:
        fail("data", f"hf:{path} alone: it holds one Dataset, no splits", f"{label!r}")
    _check_column(loaded.column_names, text_field, label)
    if len(loaded) == 0:
        fail("data", "at least one document", f"an empty dataset {label!r}")
    files = [Path(f["filename"]) for f in loaded.cache_files]
    identity = {"kind": "hf-saved", "fingerprint": loaded._fingerprint, "split": split, "text_field": text_field,
                "files": [[f.name, file_fingerprint(f)] for f in files]}
    return HFSource(label, loaded, identity, path, text_field)


def _check_column(columns: list[str] | None, text_field: str, label: str) -> None:
    if columns is not None and text_field not in columns:
        fail("text_field", f"a column {text_field!r} in the dataset", f"{label!r}, whose columns are "
             + ", ".join(map(repr, columns[:10])))


def _streamed(name: str, config: str | None, split: str, label: str, text_field: str) -> HFSource:
    """A Hub dataset, streamed; identified by the revision the Hub serves now."""
    datasets = _datasets()
    from huggingface_hub import HfApi, is_offline_mode

    if is_offline_mode():
        fail("data", f"a saved dataset, hf:PATH, when offline (hf:NAME streams from the Hub; {_FORMS})",
             f"{label!r} with HF_HUB_OFFLINE set")
    try:
        revision = HfApi().dataset_info(name).sha
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # the Hub client and datasets raise many kinds for a name they cannot serve
        fail("data", f"a dataset the Hugging Face Hub serves ({_FORMS})",
             f"{label!r}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
    _check_column(stream.column_names, text_field, label)
    identity = {"kind": "hf-hub", "name": name, "config": config, "split": split, "revision": revision,
                "text_field": text_field}
    return HFSource(label, stream, identity, None, text_field)
