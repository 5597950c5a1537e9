"""Every byte that resuming reads is checksummed: an edited checkpoint JSON is refused in one line naming it."""
import json
import shutil
from dataclasses import replace

import pytest
import torch

from lowprec.distributed import checkpoint as dist_checkpoint
from lowprec.distributed.launch import Ranks
from lowprec.optim import Optimizer
from lowprec.train.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from lowprec.train.model import build_model
from tests.train.runs import CFG, MICRO, edit_json, run

JSON = "step_00000002.json"




@pytest.fixture(scope="module")
def saved_run(data, tmp_path_factory):
    """A 2-step run with its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("run")
    run(data, out_dir=out)
    return out


def _group(key, value):
    def change(meta):
        meta["state"]["optimizer"]["optimizer"]["param_groups"][0][key] = value

    return change


def _history(rows):
    def change(meta):
        meta["state"]["history"] = meta["state"]["history"][:rows]

    return change


def _position(meta):
    meta["state"]["run"]["data"]["position"]["next_step"] = 2


EDITS = {
    "betas": _group("betas", {"__tuple__": [0.5, 0.95]}),
    "eps": _group("eps", 1e-3),
    "weight_decay": _group("weight_decay", 0.0),
    "truncated history": _history(1),
    "emptied history": _history(0),
    "data position": _position,
}


def _refused(data, out):
    with pytest.raises(CheckpointError) as caught:
        run(data, replace(CFG, steps=4), out_dir=out, resume=True)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("checkpoint: expected sha256") and JSON in message and "altered" in message
    return message


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_json_is_refused_naming_the_file(data, saved_run, tmp_path, edit):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    edit_json(out / "checkpoints" / JSON, EDITS[edit])
    _refused(data, out)


def test_a_flipped_digit_in_a_logged_loss_is_refused(data, saved_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    path = out / "checkpoints" / JSON
    text = path.read_bytes()
    at = text.index(b'"loss": ') + len(b'"loss": ') + 3  # a digit after "d.d"
    digit = text[at:at + 1]
    assert digit.isdigit()
    path.write_bytes(text[:at] + (b"1" if digit != b"1" else b"2") + text[at + 1:])
    _refused(data, out)
    assert (out / "log.csv").read_text() == (saved_run / "log.csv").read_text()  # the log was not rewritten


@pytest.mark.parametrize("where", ["body", "recorded sum", "a space"])
def test_any_byte_of_the_json_counts(tmp_path, where):
    path = save_checkpoint(tmp_path, 3, {"x": torch.ones(2), "lr": 0.001, "betas": (0.9, 0.95)})
    text = path.read_bytes()
    edited = {"body": text.replace(b"0.95", b"0.96"), "recorded sum": text[:12] + b"0" * 64 + text[76:],
              "a space": text.replace(b'"lr": ', b'"lr":  ')}[where]
    assert edited != text
    path.write_bytes(edited)
    with pytest.raises(CheckpointError, match=r"sha256 .* recorded in '.*step_00000003\.json', got .*altered"):
        load_checkpoint(path)


def test_the_json_stays_json_and_records_its_own_sum(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"x": torch.ones(2), "step": 3})
    doc = json.loads(path.read_text())
    assert list(doc) == ["sha256", "checkpoint"] and len(doc["sha256"]) == 64
    assert read_meta(path) == doc["checkpoint"] and doc["checkpoint"]["format_version"] == 2


def test_an_old_json_without_its_sum_and_a_renamed_checkpoint_are_refused(tmp_path):
    old = tmp_path / "old" / "step_00000001.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"format_version": 1, "step": 1, "tensors_file": "x", "tensors_sha256": "0" * 64,
                               "state": {}}))
    with pytest.raises(CheckpointError, match="format version 2 .*got format version 1 in .*step_00000001.json"
                                              ".*earlier lowprec"):
        load_checkpoint(old)
    path = save_checkpoint(tmp_path / "new", 1, {"x": torch.ones(1)})
    renamed = path.with_name("step_00000009.json")
    path.rename(renamed)
    with pytest.raises(CheckpointError, match="expected step 9 as its name says, got step 1"):
        load_checkpoint(renamed)


def test_an_edited_distributed_checkpoint_json_is_refused(tmp_path):
    model = build_model(MICRO, seed=0)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, master_weights=False)
    path = dist_checkpoint.save(tmp_path, 2, model, opt, Ranks(), state={"history": [{"step": 1, "loss": 5.5}]},
                                rng=dist_checkpoint.rank_rng_state(torch.device("cpu")))
    assert dist_checkpoint.read(path, Ranks())["state"]["history"][0]["loss"] == 5.5

    def change(meta):
        meta["optimizer"]["optimizer"]["param_groups"][0]["betas"] = {"__tuple__": [0.5, 0.5]}

    edit_json(path, change)
    with pytest.raises(CheckpointError, match=r"sha256 .* recorded in '.*step_00000002\.json'"):
        dist_checkpoint.read(path, Ranks())
