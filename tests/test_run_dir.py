"""An engine's socket directory (actors.run_dir): made per process, swept once its process is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.run_dir import (
    SHARED_MEMORY_LIST,
    make_run_dir,
    own_prefix,
    record_shared_memory,
    recording_shared_memory,
    remove,
    sweep_dead,
)
from tests.shm import start_segment_maker


def test_a_run_dir_is_this_processs_and_a_dead_processs_is_swept_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ours = own_prefix()
    dead = tmp_path / f"{ours}{gone.pid}"
    (dead / "sub").mkdir(parents=True)
    (dead / "kv-events").touch()
    live = tmp_path / f"{ours}1"  # pid 1 always runs
    other_host = tmp_path / f"tandem-engine-0badf00d-{gone.pid}"  # a container sharing /tmp: not ours to judge
    unrelated = tmp_path / f"{ours}notapid"
    for path in (live, other_host, unrelated):
        path.mkdir()

    mine = make_run_dir(tmp_path)

    assert mine == tmp_path / f"{ours}{os.getpid()}" and mine.is_dir() and not any(mine.iterdir())
    # A socket in it fits a Unix socket's 107 bytes wherever the temp dir is short (vLLM
    # names its sockets with a 36-character uuid).
    assert len(f"/tmp/{mine.name}/{'x' * 36}") < 90
    assert not dead.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
    (mine / "socket").touch()
    assert make_run_dir(tmp_path) == mine and not any(mine.iterdir())  # made again: empty again
    assert sweep_dead(tmp_path) == []


@pytest.mark.parametrize("kind", ["shared_memory", "semaphore"])
def test_the_shared_memory_an_engine_process_maps_goes_with_its_run_dir(tmp_path: Path, kind: str) -> None:
    """A process makes a file in /dev/shm as vLLM's processes do (a segment as its executor
    queue, psm_*; a multiprocessing lock as tqdm in its engine core, sem.mp-*, which the maps
    show under the temporary name it was made with), neither unlinked by Python's resource
    tracker, and is SIGKILLed: the run dir's list names it, and sweeping the dead process's run
    dir unlinks it."""
    maker, segment = start_segment_maker(kind)  # type: ignore[arg-type]
    name = segment.name
    try:
        run_dir = tmp_path / f"{own_prefix()}{maker.pid}"
        run_dir.mkdir()
        assert record_shared_memory(run_dir, [maker.pid]) == [name]
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait()
    assert segment.exists()  # nothing else removes it
    # A list names only vLLM's files in /dev/shm: any other line is not acted on.
    bystander = tmp_path / "bystander"
    bystander.touch()
    with open(run_dir / SHARED_MEMORY_LIST, "a") as listed:
        listed.write(f"../..{bystander}\n")
    assert sweep_dead(tmp_path) == [run_dir]
    assert not segment.exists() and not run_dir.exists() and bystander.exists()


def test_what_an_engines_processes_map_while_it_starts_is_listed_before_it_is_up(tmp_path: Path) -> None:
    """An engine killed while vLLM starts it (a Ctrl-C, a start timeout) never reaches the
    record made once it is up: while it starts, what its processes map is added to the list
    every period, and the file of a process that died meanwhile stays listed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    makers = []
    try:
        with recording_shared_memory(run_dir, period_s=0.05):
            first, first_file = start_segment_maker("semaphore")
            makers.append(first)
            wait_listed(run_dir, first_file.name)
            first.send_signal(signal.SIGKILL)
            first.wait()
            second, second_file = start_segment_maker("shared_memory")
            makers.append(second)
            wait_listed(run_dir, second_file.name)
        assert _listed(run_dir) == {first_file.name, second_file.name}
    finally:
        for maker in makers:
            maker.send_signal(signal.SIGKILL)
            maker.wait()
    remove(run_dir)
    assert not first_file.exists() and not second_file.exists() and not run_dir.exists()


def wait_listed(run_dir: Path, name: str) -> None:
    deadline = time.monotonic() + 30
    while name not in _listed(run_dir):
        assert time.monotonic() < deadline, f"the recorder never listed {name}"
        time.sleep(0.05)


def _listed(run_dir: Path) -> set[str]:
    try:
        return set((run_dir / SHARED_MEMORY_LIST).read_text().split())
    except FileNotFoundError:
        return set()


def test_only_this_users_run_dirs_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead pid's directory another user made under this host's name, or a link named like
    one, is left alone, and so is what its list names (a shared temp dir is everyone's)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ours = own_prefix()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / SHARED_MEMORY_LIST).write_text("psm_not_ours\n")
    link = tmp_path / f"{ours}{gone.pid}"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert sweep_dead(tmp_path) == [] and link.is_symlink() and (elsewhere / SHARED_MEMORY_LIST).exists()

    link.unlink()
    theirs = tmp_path / f"{ours}{gone.pid}"
    theirs.mkdir()
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # as if another user had made it
    assert sweep_dead(tmp_path) == [] and theirs.is_dir()
    monkeypatch.undo()
    assert sweep_dead(tmp_path) == [theirs] and not theirs.exists()
