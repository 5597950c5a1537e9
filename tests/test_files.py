"""Outputs on the file system (``lowprec._files``): an unwritable one is refused naming its argument before any
work, and what lowprec writes atomically is left with the permissions the umask gives, not tempfile's 0600."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from lowprec._files import check_writable, with_default_mode
from lowprec.cli import main
from lowprec.policy import Policy
from lowprec.policy_file import save_policy


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writable_outputs_pass_and_nothing_is_left_behind(tmp_path):
    assert check_writable("out", tmp_path / "a" / "b", directory=True) == tmp_path / "a" / "b"
    assert check_writable("out", tmp_path / "a" / "f.json", directory=False) == tmp_path / "a" / "f.json"
    assert check_writable("out", tmp_path, directory=True) == tmp_path
    assert list(tmp_path.iterdir()) == []  # neither made nor probed-and-left


@pytest.mark.parametrize("directory", [True, False])
def test_an_output_under_a_file_is_named(tmp_path, directory):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError) as e:
        check_writable("--out", tmp_path / "f" / "x", directory=directory)
    what = "a directory" if directory else "a file"
    assert str(e.value) == (f"--out: expected {what} lowprec can write, got '{tmp_path / 'f' / 'x'}', under "
                            f"'{tmp_path / 'f'}', an existing file")


def test_an_output_of_the_wrong_kind_is_named(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"^out_dir: expected a directory lowprec can write, got .*"
                                                 r"an existing file$"):
        check_writable("out_dir", tmp_path / "f", directory=True)
    with pytest.raises(IsADirectoryError, match=r"^path: expected a file lowprec can write, got .*an existing "
                                                r"directory$"):
        check_writable("path", tmp_path, directory=False)


def test_a_directory_that_takes_no_file_is_named(tmp_path, monkeypatch):
    # where no file can be made (a read-only mount, /proc, a directory without write permission: the probe's
    # OSError, whichever it is), the error names the argument; the probe is what fails, as a first write would
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError) as e:
        check_writable("--out", tmp_path / "run", directory=True)
    assert str(e.value) == (f"--out: expected a directory lowprec can write, got '{tmp_path / 'run'}': "
                            f"'{tmp_path}' takes no new file (Permission denied)")


@pytest.mark.parametrize("args, name", [
    (["train", "--steps", "1"], "--out"),
    (["compare", "--steps", "1"], "--out"),
    (["inspect", "no-such-run"], "--out"),
    (["check", "--recipe", "fp8-current"], "--write-policy"),
])
def test_every_command_names_its_unwritable_output_before_any_work(tmp_path, args, name):
    (tmp_path / "f").write_text("")
    out = str(tmp_path / "f" / "x")
    result = CliRunner().invoke(main, [*args, name, out])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {name}: expected "), result.output
    assert f"under '{tmp_path / 'f'}', an existing file" in result.output
    assert "Traceback" not in result.output and "steps on" not in result.output  # refused before the banner


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_default_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        f, d = tmp_path / "f", tmp_path / "d"
        f.write_text("")
        f.chmod(0o600)
        d.mkdir(mode=0o700)
        assert _mode(with_default_mode(f)) == 0o666 & ~umask
        assert _mode(with_default_mode(d)) == 0o777 & ~umask
        assert os.umask(umask) == umask  # the umask is left as it was
    finally:
        os.umask(old)


def test_a_saved_policy_is_readable_by_others(tmp_path, umask_022):
    path = save_policy(Policy(), tmp_path / "p.json")
    assert _mode(path) == 0o644  # it was tempfile's 0600


def test_an_export_is_readable_by_others(tmp_path, umask_022):
    from lowprec.export import export
    from lowprec.train.models import load_model

    model, _ = load_model("tiny", vocab_size=256, seed=0)
    export(model, tmp_path / "out", "hf")
    out = tmp_path / "out"
    assert _mode(out) == 0o755  # it was mkdtemp's 0700, which kept a serving engine's user out
    files = list(out.rglob("*"))
    assert files and all(_mode(p) == (0o755 if p.is_dir() else 0o644) for p in files)


def test_the_umask_is_read_as_it_is():
    from lowprec._files import umask

    old = os.umask(0o027)
    try:
        assert umask() == 0o027
        assert os.umask(0o027) == 0o027  # and left as it was
    finally:
        os.umask(old)


def test_an_output_made_beside_its_path_is_probed_there(tmp_path, monkeypatch):
    # an export's files are made in a directory beside --out and renamed into place: an existing, writable,
    # empty --out in a parent that takes no file would have failed after all the work
    import tempfile

    out = tmp_path / "out"
    out.mkdir()
    real = tempfile.mkstemp

    def parent_refuses(*args, dir=None, **kwargs):
        if Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", parent_refuses)
    assert check_writable("--out", out, directory=True) == out  # a run directory's files go inside it
    with pytest.raises(PermissionError, match=rf"^--out: expected a directory lowprec can write, got '{out}': "
                                              rf"'{tmp_path}' takes no new file \(Permission denied\)$"):
        check_writable("--out", out, directory=True, beside=True)


def test_an_export_into_the_current_directory_is_refused_before_any_work(tmp_path, monkeypatch):
    # it was "PosixPath('.') has an empty name", after all the work; replacing the directory a shell stands
    # in would leave it in a deleted one
    from lowprec.export import export
    from lowprec.train.models import load_model

    here = tmp_path / "here"
    (here / "below").mkdir(parents=True)
    monkeypatch.chdir(here / "below")
    model = load_model("tiny", vocab_size=256, seed=0)[0]
    for out in (".", "..", str(here)):
        with pytest.raises(ValueError, match=r"^out_dir: expected a directory other than the current one or one "
                                             r"above it \(an export replaces its directory whole\), got "):
            export(model, out, "hf")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["below", "here"]
