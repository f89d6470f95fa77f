"""An engine's socket directory (actors.run_dir): made per process, swept once its process is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from actors.run_dir import PREFIX, make_run_dir, sweep_dead


def test_a_run_dir_is_this_processs_and_a_dead_processs_is_swept_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    dead = tmp_path / f"{PREFIX}{host}-{gone.pid}"
    (dead / "sub").mkdir(parents=True)
    (dead / "kv-events").touch()
    live = tmp_path / f"{PREFIX}{host}-1"  # pid 1 always runs
    other_host = tmp_path / f"{PREFIX}another-host-{gone.pid}"  # a container sharing /tmp: not ours to judge
    unrelated = tmp_path / f"{PREFIX}{host}-notapid"
    for path in (live, other_host, unrelated):
        path.mkdir()

    mine = make_run_dir(tmp_path)

    assert mine == tmp_path / f"{PREFIX}{host}-{os.getpid()}" and mine.is_dir() and not any(mine.iterdir())
    assert not dead.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
    (mine / "socket").touch()
    assert make_run_dir(tmp_path) == mine and not any(mine.iterdir())  # made again: empty again
    assert sweep_dead(tmp_path) == []
