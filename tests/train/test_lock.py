"""One writer per run directory: a second run, or a resume while a run is active, is refused; a killed
holder leaves nothing stuck."""
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from lowprec.train.data import load_data
from lowprec.train.lock import LOCK_FILE, RunDirectoryLocked, run_directory_lock
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import forked
from tests.train.runs import CFG, run

ROOT = Path(__file__).resolve().parents[2]
_HOLDER = """
import sys, time
from lowprec.train.lock import run_directory_lock
with run_directory_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""




def test_another_process_holding_the_directory_refuses_a_run_until_it_is_killed(data, tmp_path):
    out = tmp_path / "run"
    run(data, out_dir=out)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        expected = (f"out_dir: expected a directory no other run is writing, got '{out}', locked by process "
                    f"{holder.pid} (wait for it to end, or choose another directory)")
        for resume in (True, False):  # a resume, or a fresh run, while the other one writes
            with pytest.raises(RunDirectoryLocked) as caught:
                run(data, replace(CFG, steps=3), out_dir=out, resume=resume)
            assert str(caught.value) == expected
        assert [r["step"] for r in read_log(out / "log.csv")] == ["1", "2"]  # nothing written
        holder.send_signal(signal.SIGKILL)  # no chance to unlock: the kernel releases its lock
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert (out / LOCK_FILE).is_file()  # left behind, and locking nothing
    grown = run(data, replace(CFG, steps=3), out_dir=out, resume=True)
    assert grown.steps == 3


def test_a_resume_while_the_run_is_active_is_refused_and_the_lock_ends_with_the_run(data, tmp_path):
    refusals = []

    def resume_meanwhile(row):
        if row["step"] == 1:
            with pytest.raises(RunDirectoryLocked, match=f"locked by process {os.getpid()} "):
                run(data, out_dir=tmp_path, resume=True)
            refusals.append(row["step"])

    run(data, replace(CFG, save_every=1), out_dir=tmp_path, on_step=resume_meanwhile)
    assert refusals == [1]
    assert run(data, replace(CFG, steps=3), out_dir=tmp_path, resume=True).steps == 3  # released at the end


def _train_in_locked(out: Path) -> None:
    try:
        run(load_data(), replace(CFG, parallel="ddp"), out_dir=out)
    except RunDirectoryLocked as e:
        (out.parent / f"error_{dist.get_rank()}.txt").write_text(str(e))


def test_every_rank_is_refused_alike(tmp_path):
    out = tmp_path / "run"
    with run_directory_lock(out):  # this process holds it; the ranks forked from it are other writers
        forked(_train_in_locked, out, store=tmp_path / "store")
    messages = [(tmp_path / f"error_{r}.txt").read_text() for r in (0, 1)]
    assert messages[0] == messages[1] and f"locked by process {os.getpid()} " in messages[0]
    assert not (out / "log.csv").exists()


def test_a_file_where_the_run_directory_should_be_is_named(tmp_path):
    (tmp_path / "f").write_text("")
    # it was mkdir's bare FileExistsError
    with pytest.raises(NotADirectoryError) as e, run_directory_lock(tmp_path / "f"):
        pass
    assert str(e.value) == f"out_dir: expected a directory lowprec can write, got '{tmp_path / 'f'}', an existing file"
