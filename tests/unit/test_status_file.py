"""The status file that container health checks read: believed only while its writer is alive."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.status_file import LISTENING, read_status_file, write_status_file
from specserve.cli import main as cli_main


def test_a_live_writer_is_believed(tmp_path: Path) -> None:
    path = tmp_path / "status"
    assert read_status_file(path) == ""
    write_status_file(path, "READY")
    assert read_status_file(path) == "READY"
    write_status_file(path, "DRAINING")
    assert read_status_file(path) == "DRAINING"


def test_a_file_left_by_a_process_that_ended_says_nothing(tmp_path: Path) -> None:
    path = tmp_path / "status"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from common.status_file import "
            "write_status_file; write_status_file(Path(sys.argv[1]), 'READY')",
            str(path),
        ],
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert path.read_text().startswith("READY\n")
    assert read_status_file(path) == ""


def test_the_same_pid_started_later_is_not_the_writer(tmp_path: Path) -> None:
    """A restarted container's process has the pid its predecessor had (1): the start time tells them apart."""
    path = tmp_path / "status"
    write_status_file(path, LISTENING)
    state, writer = path.read_text().splitlines()
    pid, started = writer.split()
    assert pid == str(os.getpid())
    path.write_text(f"{state}\n{pid} {int(started) - 1}\n")
    assert read_status_file(path) == ""


def test_a_file_without_a_writer_says_nothing(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text("READY\n")  # the old format, or anything else
    assert read_status_file(path) == ""


def test_healthcheck_follows_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "status"
    assert cli_main(["healthcheck", "--status-file", str(path)]) == 1
    write_status_file(path, "LOADING")
    assert cli_main(["healthcheck", "--status-file", str(path)]) == 1
    write_status_file(path, "READY")
    assert cli_main(["healthcheck", "--status-file", str(path)]) == 0
