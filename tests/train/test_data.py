import hashlib
import time

import numpy as np
import pytest
import torch

from lowprec.train import corpus as corpus_mod
from lowprec.train.corpus import build_corpus
from lowprec.train.data import MAX_INFERRED_VOCAB, corpus_data, load_data


def test_corpus_is_deterministic_capped_and_fast():
    start = time.perf_counter()
    a = build_corpus()
    assert time.perf_counter() - start < 2.0
    b = build_corpus()
    assert a.data == b.data and a.sha256 == b.sha256
    assert a.sha256 == hashlib.sha256(a.data).hexdigest()
    assert len(a.data) == corpus_mod.DEFAULT_CAP_BYTES
    assert b"def " in a.data and b"\r\n" not in a.data
    small = build_corpus(1000)
    assert small.data == a.data[:1000]


def test_corpus_leaves_out_tests_and_third_party_code():
    root = corpus_mod.stdlib_root()
    rel = [p.relative_to(root).parts for p in corpus_mod._source_files(root)]
    assert rel and all(parts[-1].endswith(".py") for parts in rel)
    assert not any({"test", "tests", "site-packages", "encodings"} & set(parts[:-1]) for parts in rel)
    assert [("/".join(p)) for p in rel] == sorted("/".join(p) for p in rel)


def test_corpus_split_is_fixed_and_covers_every_byte():
    data = corpus_data()
    whole = build_corpus().data
    assert bytes(data.train) + bytes(data.val) == whole
    assert len(data.val) == int(len(whole) * 0.05)
    assert data.vocab_size == 256 and data.fingerprint == hashlib.sha256(whole).hexdigest()


@pytest.fixture
def ramp(tmp_path):
    """A token file whose token at position i is i: a window's content tells where it came from."""
    path = tmp_path / "ramp.npy"
    np.save(path, np.arange(10_000, dtype=np.uint32))
    return load_data(path, val_fraction=0.1)


def test_train_batches_are_contiguous_windows_of_the_train_split(ramp):
    x, y = ramp.train_batch(seed=1, step=5, n_micro=3, batch_size=4, seq_len=16)
    assert x.shape == y.shape == (3, 4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)  # next-token targets
    torch.testing.assert_close(x[..., 1:], x[..., :-1] + 1, rtol=0, atol=0)  # contiguous
    assert int(y.max()) < 9_000  # never reads the validation split
    assert len(set(x[..., 0].flatten().tolist())) > 1


def test_train_batches_depend_on_seed_and_step_only(ramp):
    torch.manual_seed(0)
    np.random.seed(0)
    a = ramp.train_batch(1, 5, 2, 4, 16)[0]
    torch.manual_seed(123)
    np.random.seed(123)
    assert torch.equal(a, ramp.train_batch(1, 5, 2, 4, 16)[0])
    assert not torch.equal(a, ramp.train_batch(1, 6, 2, 4, 16)[0])
    assert not torch.equal(a, ramp.train_batch(2, 5, 2, 4, 16)[0])


def test_val_batches_are_evenly_spaced_in_the_val_split(ramp):
    batches = ramp.val_batches(n_batches=2, batch_size=3, seq_len=10)
    starts = [int(s) for x, _ in batches for s in x[:, 0]]
    expected = np.linspace(9_000, 9_000 + 1_000 - 11, 6).astype(np.int64).tolist()
    assert starts == expected
    assert ramp.val_batches(2, 3, 10)[1][1].tolist() == batches[1][1].tolist()


def test_bin_file_is_memory_mapped_with_vocab_rounded_to_32(tmp_path):
    path = tmp_path / "t.bin"
    tokens = (np.arange(5000) % 300).astype(np.uint16)
    tokens.tofile(path)
    data = load_data(path)
    assert isinstance(data.train, np.memmap)
    assert data.vocab_size == 320
    assert np.array_equal(np.concatenate([data.train, data.val]), tokens)
    wide = tmp_path / "w.bin"
    tokens.astype(np.uint32).tofile(wide)
    assert np.array_equal(load_data(wide, token_dtype="uint32").train, data.train)


def test_text_directory_is_read_sorted_skipping_binaries_and_hidden(tmp_path):
    (tmp_path / "b.txt").write_text("bravo " * 50)
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("charlie " * 50)
    (tmp_path / "blob.bin.dat").write_bytes(b"\xff\xfe\x00" * 10)
    (tmp_path / ".hidden").write_text("secret")
    data = load_data(tmp_path, val_fraction=0.5)
    text = bytes(data.train) + bytes(data.val)
    assert text == ("alpha " * 50 + "\n\n" + "bravo " * 50 + "\n\n" + "charlie " * 50).encode()
    assert "3 files" in data.source


def _truncate(path, n: int):
    path.write_bytes(path.read_bytes()[:n])
    return path


@pytest.mark.parametrize("make, kwargs, exc, match", [
    (lambda d: d / "missing.txt", {}, FileNotFoundError, "data: expected an existing file or directory, got '"),
    (lambda d: (d / "x.bin").write_bytes(b"abc") and d / "x.bin", {}, ValueError, "multiple of 2 \\(uint16\\)"),
    (lambda d: (d / "x.bin").write_bytes(b"abcd") and d / "x.bin", {"token_dtype": "int8"}, ValueError,
     "token_dtype: expected one of 'uint16', 'uint32', got 'int8'"),
    (lambda d: np.save(d / "x.npy", np.zeros((4, 4), np.int32)) or d / "x.npy", {}, ValueError,
     "data: expected a 1-D integer array"),
    (lambda d: (d / "x.txt").write_bytes(b"\xff\xfe\xfa") and d / "x.txt", {}, ValueError, "not UTF-8 text"),
    # numpy's own errors were "mmap length is greater than file size" and "... allow_pickle=..."
    (lambda d: np.save(d / "x.npy", np.arange(100, dtype=np.uint16)) or _truncate(d / "x.npy", 150), {}, ValueError,
     "data: expected a .npy file of token ids, as numpy.save writes it, got '.*', which numpy cannot read \\(mmap"),
    (lambda d: (d / "x.npy").write_bytes(b"not numpy at all") and d / "x.npy", {}, ValueError,
     "data: expected a .npy file of token ids, as numpy.save writes it, got '.*', which numpy cannot read"),
    (lambda d: (d / "empty").mkdir() or d / "empty", {}, ValueError, "data: expected text to train on"),
])
def test_bad_data_is_refused_with_the_argument_named(tmp_path, make, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        load_data(make(tmp_path), **kwargs)


def test_sequence_longer_than_a_split_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 100)
    data = load_data(tmp_path / "t.txt", val_fraction=0.1)
    with pytest.raises(ValueError) as e:
        data.val_batches(1, 1, 64)
    assert str(e.value) == (f"seq_len: expected at most 8 (data {data.source}: 100 tokens, its validation split 10; "
                            "64 needs at least 660 tokens), got 64")


def test_data_too_small_for_any_sequence_says_its_size_and_the_least_it_needs(tmp_path):
    (tmp_path / "t.txt").write_text("hello world!")
    data = load_data(tmp_path / "t.txt")
    # it read "seq_len: expected at most -1 (the validation split has 1 tokens)"
    for draw in (lambda: data.train_batch(0, 0, 1, 2, 128), lambda: data.val_batches(1, 2, 128)):
        with pytest.raises(ValueError) as e:
            draw()
        assert str(e.value) == ("data: expected at least 2,600 tokens, for one sequence of seq_len 128 in each of the "
                                f"training and validation (last 5%) splits, got {data.source}: 12 tokens")
    (tmp_path / "t.txt").write_text("x" * 2600)
    assert len(load_data(tmp_path / "t.txt").val) == 128 + 2  # the least it needs is enough


def _ids(tmp_path, ids, dtype=np.int64):
    path = tmp_path / "ids.npy"
    tokens = np.arange(1000, dtype=dtype) % 300
    tokens[417] = ids
    np.save(path, tokens)
    return path


@pytest.mark.parametrize("stray", [3_000_000, 2**40])
def test_one_stray_token_id_does_not_set_the_vocabulary(tmp_path, stray):
    # it did: 3,000,000 built a 3M-row embedding and LM head, 2^40 an allocation error
    path = _ids(tmp_path, stray)
    with pytest.raises(ValueError, match=rf"^data: expected token ids below {MAX_INFERRED_VOCAB:,} \(.*"
                                         rf"--vocab-size\), got {stray:,} at position 417 of '.*ids.npy'$"):
        load_data(path)
    with pytest.raises(ValueError, match=rf"^data: expected token ids below the vocabulary size 50,304, got "
                                         rf"{stray:,} at position 417 of '.*ids.npy'$"):
        load_data(path, vocab_size=50_304)


def test_a_given_vocabulary_is_used_when_every_id_is_below_it(tmp_path):
    path = _ids(tmp_path, 299)
    assert load_data(path).vocab_size == 320  # inferred: the largest id + 1, rounded up to 32
    assert load_data(path, vocab_size=300).vocab_size == 300
    with pytest.raises(ValueError, match="got 299 at position 299 of"):  # the first of the largest
        load_data(path, vocab_size=299)
    largest = _ids(tmp_path, MAX_INFERRED_VOCAB - 1)
    assert load_data(largest).vocab_size == MAX_INFERRED_VOCAB
    assert load_data(None, vocab_size=512).vocab_size == 512  # bytes, in a larger vocabulary
    with pytest.raises(ValueError, match=r"vocab_size: expected at least 256 for byte-level text"):
        load_data(None, vocab_size=100)
    with pytest.raises(ValueError, match=r"vocab_size: expected a positive int, got 0"):
        load_data(path, vocab_size=0)


def test_negative_token_ids_are_refused_where_they_are(tmp_path):
    with pytest.raises(ValueError, match=r"data: expected non-negative token ids, got -5 at position 417 of"):
        load_data(_ids(tmp_path, -5))


def test_the_source_gives_size_and_hash_so_that_a_changed_file_is_told_apart(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("abc\r\n" * 10)
    data = load_data(path)
    text = b"abc\n" * 10
    assert data.source == f"text: {path} (1 file, 40 bytes, sha256 {hashlib.sha256(text).hexdigest()[:12]})"
    path.write_text("abd\r\n" * 10)
    assert load_data(path).source != data.source  # same size, another hash
    ids = tmp_path / "t.npy"
    np.save(ids, np.arange(100, dtype=np.uint16))
    tokens = load_data(ids)
    assert tokens.source == (f"tokens: {ids} (100 uint16, {ids.stat().st_size} bytes, fingerprint "
                             f"{tokens.fingerprint[:12]})")


def test_a_directory_follows_symbolic_links_to_files_and_says_so(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "linked.txt").write_text("linked " * 20)
    (outside / "sub" / "deep.txt").write_text("deep " * 20)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "own.txt").write_text("own " * 20)
    (data_dir / "b-link.txt").symlink_to(outside / "linked.txt")
    (data_dir / "c-dir").symlink_to(outside / "sub")  # a linked directory is not descended into
    data = load_data(data_dir, val_fraction=0.5)
    assert bytes(data.train) + bytes(data.val) == ("linked " * 20 + "\n\n" + "own " * 20).encode()
    assert data.source.startswith(f"text: {data_dir} (2 files, 1 through symbolic links, 222 bytes, ")


def test_a_directory_mixing_text_and_jsonl_is_refused_not_read_as_text(tmp_path):
    (tmp_path / "notes.txt").write_text("alpha " * 50)
    (tmp_path / "docs.jsonl").write_text('{"text": "bravo"}\n')
    with pytest.raises(ValueError, match=r"^data: expected a directory whose files are all of one kind .*, got "
                                         r"'.*' holding 1 jsonl, 1 other files$"):
        load_data(tmp_path)


@pytest.mark.parametrize("path, kwargs, match", [
    (None, {"tokenizer": "gpt2"}, "^tokenizer: expected text to tokenize .*, got 'gpt2' with the embedded corpus"),
    (None, {"text_field": "body"}, "^text_field: expected jsonl, parquet, arrow or hf: data, whose records have "
                                   "fields, got 'body' with the embedded corpus"),
])
def test_the_corpus_takes_no_tokenizer_and_no_text_field(path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_data(path, **kwargs)


def test_a_tokenizers_vocabulary_is_padded_to_32_unless_one_is_given(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(40)} | {"</s>": 40},
                                                           unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.jsonl").write_text("".join(f'{{"text": "w{i % 40} w{(i * 7) % 40}"}}\n' for i in range(300)))
    data = load_data(tmp_path / "d.jsonl", tokenizer=tmp_path / "tokenizer.json")
    assert data.vocab_size == 64 and int(max(data.train.max(), data.val.max())) == 40  # 41 ids, padded to 64
    given = load_data(tmp_path / "d.jsonl", tokenizer=tmp_path / "tokenizer.json", vocab_size=41)
    assert given.vocab_size == 41 and given.fingerprint == data.fingerprint  # the model's size, not the data's
