"""The trouble score's floors against the reference runs of every preset recipe: a short run of each on a
two-block model of width 128 (wide enough for fp8-blockwise's 128-blocks) over the embedded corpus, with
telemetry, flags no layer. (An injected fault is still flagged: tests/telemetry/test_inspect.py.)"""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from lowprec import recipes
from lowprec.telemetry.records import read_records
from lowprec.telemetry.trouble import TROUBLE_THRESHOLD, rank_layers
from lowprec.train.model import ModelConfig
from tests.train.runs import CFG, build_model, run

WIDE = ModelConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, max_seq_len=64)
REFERENCE = replace(CFG, steps=6, eval_every=6, warmup_steps=1, batch_size=2, telemetry_every=2)


@pytest.fixture(scope="module")
def data():
    from lowprec.train.data import corpus_data
    return corpus_data()


@pytest.mark.parametrize("recipe", [r for r in recipes.names() if recipes.get(r).low_precision])
def test_a_reference_run_of_every_preset_flags_no_layer(recipe, data, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GEMMs emulated on the CPU
        run(data, replace(REFERENCE, recipe=recipe), model=build_model(WIDE, seed=0), out_dir=tmp_path,
            checkpoints=False)
    records = read_records(tmp_path / "telemetry.csv")
    assert {r.step for r in records} == {2, 4, 6} and all(r.fmt is not None for r in records)
    ranked = rank_layers(records)
    flagged = [(t.layer, t.worst, str(t.flag)) for t in ranked if t.score >= TROUBLE_THRESHOLD]
    assert flagged == [], flagged
