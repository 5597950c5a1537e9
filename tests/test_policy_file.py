import json

import pytest
import torch.nn as nn

import lowprec
from lowprec.policy import Policy
from lowprec.policy_file import CONVERT_SMALL, load_policy, policy_from_dict, save_policy


def test_a_policy_round_trips_through_its_file(tmp_path):
    policy = Policy(exclude=("layers.0.*", "*.w2"), skip_small=False, keep_first_blocks=1, keep_last_blocks=0,
                    min_features=512, share_inputs=(("a", "b"),))
    path = save_policy(policy, tmp_path / "sub" / "p.json")
    assert load_policy(path) == policy
    doc = json.loads(path.read_text())
    assert doc["format"] == "lowprec-policy" and doc["version"] == 1
    # only what differs from the defaults is written
    assert set(doc["policy"]) == {"exclude", "skip_small", "keep_first_blocks", "keep_last_blocks", "min_features",
                                  "share_inputs"}
    assert load_policy(save_policy(Policy(), tmp_path / "d.json")) == Policy()


def test_a_loaded_policy_converts_what_it_says():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    report = lowprec.convert(model, "fp8-current", policy_from_dict({"exclude": ["0"], "skip_small": False}))
    assert [lr.converted for lr in report.layers] == [False, True]


@pytest.mark.parametrize("data, match", [
    ({"exlcude": ["x"]}, r"unknown field\(s\) 'exlcude'"),
    ({"exclude": "layers.*"}, "policy.exclude: expected a list of glob patterns"),
    ({"min_features": 0}, "min_features: expected a positive int"),
    ([1, 2], "expected a JSON object of Policy fields"),
])
def test_bad_fields_are_named(data, match):
    with pytest.raises(ValueError, match=match):
        policy_from_dict(data)


def test_a_predicate_cannot_be_written(tmp_path):
    with pytest.raises(ValueError, match="policy.exclude: expected glob patterns"):
        save_policy(Policy(exclude=lambda name, m: True), tmp_path / "p.json")


@pytest.mark.parametrize("text, match", [
    (None, "which is not a file"),
    ("{not json", "which is not valid JSON"),
    ('{"format": "other"}', 'expected a JSON object with "format": "lowprec-policy"'),
    ('{"format": "lowprec-policy", "version": 9}', "expected version 1 of the policy file"),
])
def test_bad_files_are_refused(tmp_path, text, match):
    path = tmp_path / "p.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_policy(path)


def test_the_file_the_messages_quote_converts_small_layers(tmp_path):
    """Every message about layers kept as too small quotes CONVERT_SMALL as the file to pass: it must load."""
    (tmp_path / "p.json").write_text(CONVERT_SMALL)
    assert load_policy(tmp_path / "p.json").skip_small is False
