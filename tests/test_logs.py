"""actors.logs: the cause a child process wrote to the log it shares with its parent (how an
engine actor learns why vLLM's engine core did not start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHARED_LOG = """
import subprocess, sys
from actors.logs import last_error, stderr_size
print("Traceback (most recent call last):\\nOldError: written before the parent looked", file=sys.stderr, flush=True)
at = stderr_size()
print(last_error(at))
subprocess.run([sys.executable, "-c", "import sys; print('INFO starting: not an error', file=sys.stderr); "
                "raise ValueError('the root cause')"])
print(last_error(at))
"""


def test_the_last_error_a_child_wrote_to_the_shared_log_is_found_and_nothing_older(tmp_path: Path) -> None:
    with (tmp_path / "worker.err").open("w") as log:
        out = subprocess.run([sys.executable, "-c", SHARED_LOG], stdout=subprocess.PIPE, stderr=log, text=True, check=True)
    assert out.stdout.splitlines() == ["None", "ValueError: the root cause"]


def test_nothing_is_read_where_stderr_is_no_file() -> None:
    out = subprocess.run([sys.executable, "-c", "from actors.logs import last_error, stderr_size; print(stderr_size(), last_error(0))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "None"]
