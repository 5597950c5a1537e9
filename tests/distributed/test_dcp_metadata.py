"""A distributed checkpoint's ``.metadata`` runs no code: the names a real one holds load, any other is refused.

Each forged ``.metadata`` below is a real one with one object more, whose unpickling would create a
file; the checkpoint's JSON is then rewritten with the forged file's sha256 and its own, as whoever
forged the file would. Loading must refuse it in one line naming the file and the name refused, and
the file must not exist afterwards.
"""
from __future__ import annotations

import builtins
import hashlib
import io
import os
import pathlib
import pickle
import shutil
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from lowprec.cli import main
from lowprec.distributed import checkpoint as dist_checkpoint
from lowprec.distributed import safe_metadata
from lowprec.distributed.launch import Ranks
from lowprec.optim import Optimizer
from lowprec.train.checkpoint import CheckpointError, encode_meta, read_meta
from lowprec.train.model import build_model
from tests.distributed.launch_helpers import MICRO, forked_cli


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" is expected here
        yield


class _RunsCode:
    """Unpickled, calls ``fn(arg)``: what a forged ``.metadata`` would carry."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


CALLS = [(builtins.exec, "open({marker!r}, 'w').close()"), (os.system, "touch '{marker}'"), (pathlib.Path.touch, None)]
"""Three ways to create a file ``marker``; the last is given the path itself."""
NAMES = [f"{fn.__module__}.{fn.__qualname__}" for fn, _ in CALLS]
"""The name each call's pickle holds (``posix.system`` on Linux)."""


def _payload(name: str, marker: pathlib.Path) -> _RunsCode:
    fn, arg = CALLS[NAMES.index(name)]
    return _RunsCode(fn, marker if arg is None else arg.format(marker=str(marker)))


def _model_and_optimizer():
    model = build_model(MICRO, seed=0)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opt.backward(model(x).float().logsumexp(-1).mean())
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real distributed checkpoint, saved by one process through DCP: its JSON and the model saved."""
    model, opt = _model_and_optimizer()
    json_path = dist_checkpoint.save(tmp_path_factory.mktemp("saved"), 1, model, opt, Ranks(), state={},
                                     rng=dist_checkpoint.rank_rng_state(torch.device("cpu")))
    return json_path, {k: v.clone() for k, v in model.state_dict().items()}


def _copy(json_path: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    shutil.copytree(json_path.parent, to)
    return to / json_path.name


def forge(json_path: pathlib.Path, edit) -> pathlib.Path:
    """The checkpoint's ``.metadata`` replaced by ``edit(metadata)`` pickled, the JSON's sha256 made to fit."""
    directory = json_path.with_suffix("")
    path = directory / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # written by this test
    path.write_bytes(pickle.dumps(edit(metadata)))
    meta = read_meta(json_path)
    meta["files_sha256"][".metadata"] = hashlib.sha256(path.read_bytes()).hexdigest()
    json_path.write_bytes(encode_meta(meta))
    return path


def _with(**fields):
    def edit(metadata):
        for k, v in fields.items():
            setattr(metadata, k, v)
        return metadata

    return edit


def test_a_real_checkpoint_holds_only_admitted_names_and_reads_as_pickle_reads_it(saved):
    json_path, _ = saved
    path = json_path.with_suffix("") / ".metadata"
    names = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        unrestricted = Recording(f).load()
    assert names <= set(safe_metadata.ADMITTED), names - set(safe_metadata.ADMITTED)
    assert ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata") in names
    assert safe_metadata.read_metadata(path, os.listdir(path.parent)) == unrestricted


def test_a_real_checkpoint_loads_through_the_restricted_reader(saved):
    json_path, state = saved
    model, opt = _model_and_optimizer()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dist_checkpoint.load(json_path, dist_checkpoint.read(json_path, Ranks()), model, opt, Ranks())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("refused", NAMES)
def test_a_metadata_that_would_run_code_is_refused_and_nothing_runs(saved, tmp_path, refused):
    marker = tmp_path / "ran"
    json_path = _copy(saved[0], tmp_path / "ckpt")
    path = forge(json_path, _with(planner_data={"x": _payload(refused, marker)}))
    meta = dist_checkpoint.read(json_path, Ranks())  # its sha256 holds: the JSON was rewritten to fit
    model, opt = _model_and_optimizer()
    with pytest.raises(CheckpointError) as e:
        dist_checkpoint.load(json_path, meta, model, opt, Ranks())
    assert str(e.value) == (f"checkpoint: expected DCP's metadata classes alone in {str(path)!r}, got {refused}, "
                            "refused (unpickling it could run code)")
    assert not marker.exists()


@pytest.mark.parametrize("edit, refused", [
    (_with(state_dict_metadata={"model/x": BytesStorageMetadata()}),
     "torch.distributed.checkpoint.metadata.BytesStorageMetadata, refused"),
    (lambda m: _with(storage_data={k: _moved(v, "../__0_0.distcp") for k, v in m.storage_data.items()})(m),
     "pieces in files of the checkpoint's directory in .*, got '../__0_0.distcp'"),
    (lambda m: _with(storage_data={k: _moved(v, "elsewhere.distcp") for k, v in m.storage_data.items()})(m),
     "pieces in files whose sha256 was verified in .*, got 'elsewhere.distcp', not among them"),
    (lambda m: _with(storage_data={k: _moved(v, v.relative_path, ["zstd"]) for k, v in m.storage_data.items()})(m),
     r"no stream transforms\) in .*, got \['zstd'\]"),
    (_with(state_dict_metadata={"model/x": 3}), "a tensor .* under each key in .*, got int under 'model/x'"),
])
def test_a_metadata_of_another_shape_is_refused(saved, tmp_path, edit, refused):
    json_path = _copy(saved[0], tmp_path / "ckpt")
    path = forge(json_path, edit)
    with pytest.raises(CheckpointError, match=f"^checkpoint: expected .*{refused}"):
        safe_metadata.read_metadata(path, read_meta(json_path)["files_sha256"])


def _moved(info, relative_path, transforms=None):
    return type(info)(relative_path, info.offset, info.length, transforms)


def test_a_damaged_metadata_is_refused_in_one_line(saved, tmp_path):
    json_path = _copy(saved[0], tmp_path / "ckpt")
    path = json_path.with_suffix("") / ".metadata"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"^checkpoint: expected DCP's metadata in .*\.metadata', got \w+") as e:
        safe_metadata.read_metadata(path)
    assert "\n" not in str(e.value)


def test_the_reader_reads_no_bytes_item(saved):
    # DCP's planner would read one with torch.load(weights_only=False)
    reader = safe_metadata.MetadataReader(saved[0].with_suffix(""))
    index = MetadataIndex("state")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="expected tensors alone in .*, got a non-tensor entry 'state'"):
        reader.read_data(LoadPlan([item]), planner=None)


RUN = ("train", "--recipe", "bf16", "--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
       "--val-batches", "2", "--eval-every", "2", "--save-every", "2", "--no-tensorboard", "--quiet")


def test_train_resume_refuses_a_forged_metadata_on_every_rank_and_in_one_process(tmp_path):
    # the attack as tried: an FSDP2 run's checkpoint forged, then `train --parallel fsdp2 --resume` (on two
    # ranks as torchrun starts them), and the same checkpoint resumed in one process (resharding 2 -> 1)
    out, marker = tmp_path / "run", tmp_path / "ran"
    ranks = forked_cli(*RUN, "--parallel", "fsdp2", "--out", str(out), out=tmp_path / "save")
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    (out / "checkpoints" / "step_00000004.json").unlink()
    path = forge(out / "checkpoints" / "step_00000002.json",
                 _with(planner_data=_payload("builtins.exec", marker)))
    line = (f"Error: checkpoint: expected DCP's metadata classes alone in {str(path)!r}, got builtins.exec, "
            "refused (unpickling it could run code)")
    ranks = forked_cli(*RUN, "--parallel", "fsdp2", "--out", str(out), "--resume", out=tmp_path / "resume")
    assert [(r["exit_code"], r["error"]) for r in ranks] == [(1, None), (1, None)], ranks
    # rank 0 says it; a rank no launcher stops (forked here, not torchrun) says it after its wait, naming itself
    assert [r["stderr"].strip() for r in ranks] == [line, line.replace("Error: ", "Error: rank 1: ", 1)], ranks
    one = CliRunner().invoke(main, [*RUN, "--out", str(out), "--resume"])
    assert one.exit_code == 1 and one.stderr.strip() == line, one.output
    assert not marker.exists()


@pytest.mark.parametrize("name", NAMES)
def test_each_payload_runs_its_code_when_pickle_reads_it(tmp_path, name):
    # the payloads are live, so "nothing runs" above is the reader's doing
    marker = tmp_path / "ran"
    pickle.load(io.BytesIO(pickle.dumps(_payload(name, marker))))
    assert marker.exists()
