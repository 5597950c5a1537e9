import hashlib
import time

import numpy as np
import pytest
import torch

from lowprec.train import corpus as corpus_mod
from lowprec.train.corpus import build_corpus
from lowprec.train.data import corpus_data, load_data


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


@pytest.mark.parametrize("make, kwargs, exc, match", [
    (lambda d: d / "missing.txt", {}, FileNotFoundError, "data: expected an existing file or directory, got '"),
    (lambda d: (d / "x.bin").write_bytes(b"abc") and d / "x.bin", {}, ValueError, "multiple of 2 \\(uint16\\)"),
    (lambda d: (d / "x.bin").write_bytes(b"abcd") and d / "x.bin", {"token_dtype": "int8"}, ValueError,
     "token_dtype: expected one of 'uint16', 'uint32', got 'int8'"),
    (lambda d: np.save(d / "x.npy", np.zeros((4, 4), np.int32)) or d / "x.npy", {}, ValueError,
     "data: expected a 1-D integer array"),
    (lambda d: (d / "x.txt").write_bytes(b"\xff\xfe\xfa") and d / "x.txt", {}, ValueError, "not UTF-8 text"),
    (lambda d: (d / "empty").mkdir() or d / "empty", {}, ValueError, "data: expected text to train on"),
])
def test_bad_data_is_refused_with_the_argument_named(tmp_path, make, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        load_data(make(tmp_path), **kwargs)


def test_sequence_longer_than_a_split_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 100)
    data = load_data(tmp_path / "t.txt", val_fraction=0.1)
    with pytest.raises(ValueError, match="seq_len: expected at most 8 \\(the validation split has 10 tokens\\)"):
        data.val_batches(1, 1, 64)
