"""jsonl, parquet, arrow and Hugging Face data through a tokenizer, and the token cache, against the real
tokenizers, transformers, pyarrow and datasets: the ids must equal the tokenizer's own encoding of each
document, followed by its EOS token."""
import json
import os
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

datasets = pytest.importorskip("datasets", reason="the data extra (pip install 'lowprec[data]') is not installed")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

from lowprec.cli import main  # noqa: E402  (after the skips: the extra's libraries are needed)
from lowprec.train import token_cache  # noqa: E402
from lowprec.train.data import load_data  # noqa: E402
from lowprec.train.token_cache import CACHE_DIR_NAME, CACHE_ENV  # noqa: E402

WORDS = "the cat sat on a mat while one dog ran far and slept by old red door".split()
DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 6)) for i in range(160)]


def _word_tokenizer(path, *, post_eos=False, special=("[UNK]", "</s>")):
    """A WordLevel tokenizer trained on WORDS, saved as tokenizer.json; with ``post_eos`` its post-processor
    appends ``</s>`` to every encoding, as some tokenizers' do."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=list(special))
    tok.train_from_iterator([" ".join(WORDS)], trainer=trainer)
    if post_eos:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    tok.save(str(path))
    return tok


@pytest.fixture
def tok_path(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    _word_tokenizer(path)
    return path


def _reference(tok, docs, eos="</s>"):
    """The documented join, written out: each document's own encoding, then EOS unless it ends with it."""
    ids, eos_id = [], tok.token_to_id(eos)
    for d in docs:
        enc = tok.encode(d).ids
        ids += enc + ([] if enc[-1:] == [eos_id] else [eos_id])
    return ids


def _tokens(data):
    return np.concatenate([np.asarray(data.train), np.asarray(data.val)]).tolist()


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _arrow_ipc_file(path, docs):
    table = pa.table({"text": docs, "n": list(range(len(docs)))})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=50)  # several record batches
    return path


SOURCES = {
    "jsonl": lambda d: _write_jsonl(d / "docs.jsonl", DOCS),
    "jsonl directory": lambda d: (_write_jsonl((d / "set").mkdir() or d / "set" / "b.jsonl", DOCS[60:]),
                                  _write_jsonl(d / "set" / "a.jsonl", DOCS[:60]))[0].parent,
    "parquet": lambda d: pq.write_table(pa.table({"text": DOCS}), d / "docs.parquet", row_group_size=40)
    or d / "docs.parquet",
    "arrow file": lambda d: _arrow_ipc_file(d / "docs.arrow", DOCS),
    "saved dataset": lambda d: datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(d / "saved") or
    f"hf:{d / 'saved'}",
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_ids_are_the_tokenizers_own_encoding_of_each_document_then_eos(kind, tmp_path, tok_path):
    source = SOURCES[kind](tmp_path)
    data = load_data(source, tokenizer=tok_path, val_fraction=0.1)
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    assert _tokens(data) == _reference(tok, DOCS)  # the directory's files in sorted order: a.jsonl first
    assert data.train.dtype == np.uint16 and data.vocab_size == 32  # 17 words + 2 specials, padded to 32
    assert "160 documents" in data.source and "EOS '</s>'" in data.source


def test_a_saved_dataset_of_an_arrow_stream_is_read_as_an_arrow_file(tmp_path, tok_path):
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "saved")
    (shard,) = (tmp_path / "saved").glob("*.arrow")  # datasets writes the IPC stream format
    data = load_data(shard, tokenizer=tok_path)
    assert _tokens(data) == _reference(tokenizers.Tokenizer.from_file(str(tok_path)), DOCS)
    assert load_data(tmp_path / "saved", tokenizer=tok_path).fingerprint == load_data(
        f"hf:{tmp_path / 'saved'}", tokenizer=tok_path).fingerprint  # the directory alone is the same dataset


def test_a_split_of_a_saved_dataset_dict(tmp_path, tok_path):
    parts = {"train": datasets.Dataset.from_dict({"text": DOCS}), "test": datasets.Dataset.from_dict(
        {"text": DOCS[::-1]})}
    datasets.DatasetDict(parts).save_to_disk(tmp_path / "dd")
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    assert _tokens(load_data(f"hf:{tmp_path / 'dd'}", tokenizer=tok_path)) == _reference(tok, DOCS)
    test = load_data(f"hf:{tmp_path / 'dd'}:test", tokenizer=tok_path)
    assert _tokens(test) == _reference(tok, DOCS[::-1]) and "split 'test'" in test.source
    with pytest.raises(ValueError, match=r"^data: expected a split of the saved dataset \('train', 'test'\), got "
                                         r"'valid'"):
        load_data(f"hf:{tmp_path / 'dd'}:valid", tokenizer=tok_path)


def test_another_text_field(tmp_path, tok_path):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    data = load_data(path, tokenizer=tok_path, text_field="body")
    assert _tokens(data) == _reference(tokenizers.Tokenizer.from_file(str(tok_path)), DOCS)


def test_without_a_tokenizer_documents_are_bytes_each_followed_by_a_blank_line(tmp_path):
    data = load_data(_write_jsonl(tmp_path / "d.jsonl", DOCS))
    assert bytes(_tokens(data)) == "".join(d + "\n\n" for d in DOCS).encode()
    assert data.vocab_size == 256 and "bytes" in data.source


def test_a_post_processors_eos_is_not_doubled(tmp_path):
    tok = _word_tokenizer(tmp_path / "tokenizer.json", post_eos=True)
    data = load_data(_write_jsonl(tmp_path / "d.jsonl", DOCS), tokenizer=tmp_path / "tokenizer.json")
    eos = tok.token_to_id("</s>")
    assert _tokens(data) == sum((tok.encode(d).ids for d in DOCS), [])  # the encoding already ends with EOS
    assert _tokens(data).count(eos) == len(DOCS)


def test_a_tokenizer_without_eos_puts_documents_back_to_back_and_says_so(tmp_path):
    tok = _word_tokenizer(tmp_path / "tokenizer.json", special=("[UNK]",))
    with pytest.warns(UserWarning, match="has no EOS token: documents are put back to back"):
        data = load_data(_write_jsonl(tmp_path / "d.jsonl", DOCS), tokenizer=tmp_path / "tokenizer.json")
    assert _tokens(data) == sum((tok.encode(d).ids for d in DOCS), [])


def test_a_transformers_tokenizer_directory_and_its_eos(tmp_path):
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "hf-tok"
    tok_dir.mkdir()
    _word_tokenizer(tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                               "tokenizer_class": "PreTrainedTokenizerFast"}))
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    data = load_data(path, tokenizer=str(tok_dir))
    ref = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert _tokens(data) == sum((ref(d)["input_ids"] + [ref.eos_token_id] for d in DOCS), [])
    assert load_data(path, tokenizer=str(tok_dir)).fingerprint == data.fingerprint  # its identity is stable


def test_ids_past_uint16_are_stored_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = [f"w{i * 997 % 70_000} w{69_999 - i} w3" for i in range(300)]
    data = load_data(_write_jsonl(tmp_path / "d.jsonl", docs), tokenizer=tmp_path / "tokenizer.json")
    assert data.train.dtype == np.uint32 and data.vocab_size == 70_016  # 70,002 rounded up to 32
    assert _tokens(data) == _reference(tok, docs)


def _cache_files(d):
    return sorted(p.name for p in (d / CACHE_DIR_NAME).iterdir())


def test_a_second_run_reuses_the_cache_without_the_tokenizer(tmp_path, tok_path, monkeypatch):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load_data(path, tokenizer=tok_path)
    names = _cache_files(tmp_path)
    assert [n.rsplit(".", 1)[1] for n in names] == ["bin", "json"]
    stamps = {n: (tmp_path / CACHE_DIR_NAME / n).stat().st_mtime_ns for n in names}

    class NoTokenizer:
        @staticmethod
        def from_file(*_a):
            raise AssertionError("the tokenizer was loaded again")

    monkeypatch.setattr(tokenizers, "Tokenizer", NoTokenizer)
    again = load_data(path, tokenizer=tok_path)
    assert _tokens(again) == _tokens(first) and again.fingerprint == first.fingerprint
    assert isinstance(again.train, np.memmap)
    assert {n: (tmp_path / CACHE_DIR_NAME / n).stat().st_mtime_ns for n in names} == stamps


def test_the_cache_and_the_fingerprint_follow_the_files_the_tokenizer_and_the_field(tmp_path, tok_path):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load_data(path, tokenizer=tok_path)
    _write_jsonl(path, DOCS[:-1] + ["the red door"])
    changed = load_data(path, tokenizer=tok_path)
    assert changed.fingerprint != first.fingerprint
    assert _tokens(changed) == _reference(tokenizers.Tokenizer.from_file(str(tok_path)), DOCS[:-1] + ["the red door"])
    other_tok = tmp_path / "other.json"
    _word_tokenizer(other_tok, special=("[UNK]", "[PAD]", "</s>"))
    assert load_data(path, tokenizer=other_tok).fingerprint not in (first.fingerprint, changed.fingerprint)
    path.write_text("".join(json.dumps({"text": d, "alt": d}) + "\n" for d in DOCS[:-1] + ["the red door"]))
    assert load_data(path, tokenizer=tok_path, text_field="alt").fingerprint != load_data(
        path, tokenizer=tok_path).fingerprint
    assert load_data(path).fingerprint != load_data(path, tokenizer=tok_path).fingerprint  # bytes vs tokens
    assert len(_cache_files(tmp_path)) == 2 * 6


@pytest.mark.parametrize("damage, problem", [
    (lambda b, m: b.write_bytes(b.read_bytes()[:-2]), "bytes where its JSON says"),
    (lambda b, m: b.write_bytes(b"\x07\x00" + b.read_bytes()[2:]), "its sha256 differs"),
    (lambda b, m: m.write_text("{not json"), "its JSON does not read"),
    (lambda b, m: b.unlink(), "its tokens are missing"),
])
def test_a_corrupt_cache_is_rebuilt_with_a_warning(damage, problem, tmp_path, tok_path):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = _tokens(load_data(path, tokenizer=tok_path))  # read now: the damage below changes the mapped file
    (b,) = (tmp_path / CACHE_DIR_NAME).glob("*.bin")
    damage(b, b.with_suffix(".json"))
    with pytest.warns(UserWarning, match=f"token cache .* is corrupt \\(.*{problem}.*\\): tokenizing again"):
        again = load_data(path, tokenizer=tok_path)
    assert _tokens(again) == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_data(path, tokenizer=tok_path)  # whole again


def test_a_build_that_did_not_finish_is_never_taken_as_whole(tmp_path, tok_path):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    with path.open("a") as f:
        f.write("{broken\n")
    with pytest.raises(ValueError, match=r"d.jsonl, line 161"):
        load_data(path, tokenizer=tok_path)
    assert _cache_files(tmp_path) == []  # the failed build's temporary file is gone
    _write_jsonl(path, DOCS)
    first = load_data(path, tokenizer=tok_path)
    (b,) = (tmp_path / CACHE_DIR_NAME).glob("*.bin")
    b.with_suffix(".json").unlink()  # killed between the two renames: tokens without their JSON
    (b.parent / (b.name + ".tmp-1-dead")).write_bytes(b"\x01\x00")  # and a killed build's leftover
    assert _tokens(load_data(path, tokenizer=tok_path)) == _tokens(first)
    assert b.with_suffix(".json").is_file()


def test_a_cache_that_cannot_go_beside_the_data_goes_to_the_user_cache(tmp_path, tok_path, monkeypatch):
    data_dir = tmp_path / "ro"
    data_dir.mkdir()
    path = _write_jsonl(data_dir / "d.jsonl", DOCS)
    (data_dir / CACHE_DIR_NAME).write_text("a file where the cache directory would go")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "user-cache"))
    with pytest.warns(UserWarning, match=f"{CACHE_DIR_NAME} cannot be written; the tokens of jsonl: .* are cached "
                                         f"in .*user-cache"):
        first = load_data(path, tokenizer=tok_path)
    assert len(list((tmp_path / "user-cache").glob("tokens-*.bin"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found there the next time, without a word
        assert load_data(path, tokenizer=tok_path).fingerprint == first.fingerprint


def _offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _mixed_dir(d):
    (d / "m").mkdir()
    _write_jsonl(d / "m" / "a.jsonl", DOCS)
    pq.write_table(pa.table({"text": DOCS}), d / "m" / "b.parquet")
    return d / "m"


def _bad_line(d):
    (d / "bad.jsonl").write_text('{"text": "a b"}\n{"text": oops}\n')
    return d / "bad.jsonl"


def _empty_saved(d):
    datasets.Dataset.from_dict({"text": ["x"]}).filter(lambda _: False).save_to_disk(d / "empty")
    return f"hf:{d / 'empty'}"


@pytest.mark.parametrize("make, kwargs, match", [
    (_bad_line, {}, r"^data: expected a JSON object on every line of a jsonl file, got .*bad.jsonl, line 2: "),
    (lambda d: _write_jsonl(d / "x.jsonl", DOCS, field="body"), {},
     r"^text_field: expected a field 'text' on every line, got .*x.jsonl, line 1, whose fields are 'id', 'body'$"),
    (lambda d: (d / "n.jsonl").write_text('{"text": 3}\n') and d / "n.jsonl", {},
     r"^text_field: expected a string in 'text', got .*n.jsonl, line 1: 3 \(int\)$"),
    (lambda d: pq.write_table(pa.table({"body": DOCS}), d / "x.parquet") or d / "x.parquet", {},
     r"^text_field: expected a column 'text' in every parquet file, got .*x.parquet, whose columns are 'body'$"),
    (lambda d: (d / "e.jsonl").write_text("\n") and d / "e.jsonl", {},
     r"^data: expected at least one document, got none in jsonl: .*e.jsonl \(1 file, field 'text'\)$"),
    (_empty_saved, {}, r"^data: expected at least one document, got an empty dataset 'hf:.*empty'$"),
    (_mixed_dir, {}, r"^data: expected a directory whose files are all of one kind \(.jsonl, .parquet or .arrow\), "
                     r"or all text, got '.*m' holding 1 jsonl, 1 parquet files$"),
    (lambda d: _write_jsonl(d / "d.jsonl", DOCS), {"tokenizer": "no-such-org/no-such-tokenizer"},
     r"^tokenizer: expected a tokenizer.json file, .*, got 'no-such-org/no-such-tokenizer', not a file or "
     r"directory, nor in the local Hugging Face cache \(offline: HF_HUB_OFFLINE is set\): "),
    (lambda d: _write_jsonl(d / "d.jsonl", DOCS), {"tokenizer": "TMP/typo.json"},
     r"^tokenizer: expected a tokenizer.json file, .*, got '.*typo.json', a path that does not exist$"),
    (lambda d: (d / "no-tok").mkdir() or _write_jsonl(d / "d.jsonl", DOCS), {"tokenizer": "TMP/no-tok"},
     r"^tokenizer: expected a tokenizer.json file, .*, got '.*no-tok', a directory AutoTokenizer cannot load: "),
    (lambda d: (d / "t.json").write_text('{"not": "a tokenizer"}') and _write_jsonl(d / "d.jsonl", DOCS),
     {"tokenizer": "TMP/t.json"}, r"^tokenizer: expected a tokenizer.json file, .*t.json', which tokenizers cannot "
                                  r"load: "),
    (lambda d: np.save(d / "ids.npy", np.arange(1000)) or d / "ids.npy", {"tokenizer": "TOK"},
     r"^tokenizer: expected text to tokenize .*, got '.*tokenizer.json' with the token file '.*ids.npy', which "
     r"holds ids already$"),
    (lambda d: (d / "t.txt").write_text("plain text") and d / "t.txt", {"text_field": "body"},
     r"^text_field: expected jsonl, parquet, arrow or hf: data, whose records have fields, got 'body' with the "
     r"text '.*t.txt'$"),
    (lambda d: _write_jsonl(d / "d.jsonl", DOCS), {"tokenizer": "TOK", "vocab_size": 16},
     r"^vocab_size: expected at least 19, the vocabulary of tokenizer '.*tokenizer.json', got 16$"),
    (lambda d: "hf:some-org/some-dataset", {},
     r"^data: expected a saved dataset, hf:PATH, when offline .*, got 'hf:some-org/some-dataset' with "
     r"HF_HUB_OFFLINE set$"),
    (lambda d: f"hf:{d / 'missing'}", {}, r"^data: expected hf:PATH\[:SPLIT\] .*, got 'hf:.*missing', which names no "
                                          r"directory$"),
])
def test_bad_input_is_refused_in_one_line(make, kwargs, match, tmp_path, tok_path, monkeypatch):
    _offline(monkeypatch)
    source = make(tmp_path)
    kwargs = {k: str(tok_path) if v == "TOK" else v.replace("TMP", str(tmp_path)) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match) as e:
        load_data(source, **kwargs)
    assert "\n" not in str(e.value)


def test_text_files_with_a_tokenizer_are_documents(tmp_path, tok_path):
    (tmp_path / "txt").mkdir()
    for i, name in enumerate(["b.txt", "a.txt", "c.md"]):
        (tmp_path / "txt" / name).write_text("\r\n".join(DOCS[i * 50:(i + 1) * 50]))
    data = load_data(tmp_path / "txt", tokenizer=tok_path)
    files = ["\n".join(DOCS[50:100]), "\n".join(DOCS[:50]), "\n".join(DOCS[100:150])]  # a, b, c sorted
    assert _tokens(data) == _reference(tokenizers.Tokenizer.from_file(str(tok_path)), files)
    assert data.source.startswith(f"text: {tmp_path / 'txt'} (3 files)")


def test_train_on_jsonl_with_a_tokenizer_end_to_end_and_a_resume_on_other_data_is_refused(tmp_path, tok_path):
    path = _write_jsonl(tmp_path / "x.jsonl", DOCS)
    out = str(tmp_path / "run")
    small = ["--batch-size", "2", "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard"]
    args = ["train", "--data", str(path), "--tokenizer", str(tok_path), "--model", "tiny", "--out", out, *small]
    result = CliRunner().invoke(main, [*args, "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["data_sha256"] == load_data(path, tokenizer=tok_path).fingerprint
    _write_jsonl(path, DOCS[::-1])
    refused = CliRunner().invoke(main, [*args, "--steps", "3", "--resume"])
    assert refused.exit_code == 1 and "Error: data: expected the data the checkpoint was trained on" in refused.output
    assert os.listdir(tmp_path / CACHE_DIR_NAME)  # both versions cached beside the file


def test_the_cache_key_holds_the_format_version(tmp_path, tok_path, monkeypatch):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load_data(path, tokenizer=tok_path).fingerprint
    monkeypatch.setattr(token_cache, "CACHE_FORMAT", token_cache.CACHE_FORMAT + 1)
    assert load_data(path, tokenizer=tok_path).fingerprint != first


def test_a_hub_name_is_streamed_and_keyed_by_its_revision(tmp_path, tok_path, monkeypatch):
    """The Hub is out of reach here: its two answers (the revision, the stream) are stood in for by a real
    ``datasets.IterableDataset``; the parsing of the name, the streaming read and the cache are lowprec's."""
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "user-cache"))
    revision, asked = ["rev-1"], []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info",
                        lambda self, name: type("Info", (), {"sha": revision[0]})())

    def load_dataset(name, config, split, streaming):
        asked.append((name, config, split, streaming))
        return datasets.IterableDataset.from_generator(lambda: ({"text": d, "n": i} for i, d in enumerate(DOCS)))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    data = load_data("hf:some-org/stories:en:valid", tokenizer=tok_path)
    assert asked == [("some-org/stories", "en", "valid", True)]
    assert _tokens(data) == _reference(tokenizers.Tokenizer.from_file(str(tok_path)), DOCS)
    assert data.source.startswith("hf: some-org/stories:en:valid (split 'valid', field 'text'): 160 documents")
    assert len(list((tmp_path / "user-cache").glob("tokens-*.json"))) == 1
    load_data("hf:some-org/stories::valid", tokenizer=tok_path)
    assert asked[-1] == ("some-org/stories", None, "valid", True)
    assert load_data("hf:some-org/stories:en:valid", tokenizer=tok_path).fingerprint == data.fingerprint
    revision[0] = "rev-2"  # the dataset changed on the Hub
    assert load_data("hf:some-org/stories:en:valid", tokenizer=tok_path).fingerprint != data.fingerprint
    load_data("hf:some-org/stories", tokenizer=tok_path)
    assert asked[-1] == ("some-org/stories", None, "train", True)
