"""Worker ids from slots: copies sharing a folder get distinct ids, and a restarted copy gets a free one back."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import slots

ROOT = Path(__file__).resolve().parents[2]
_HOLDER = (
    "import sys, time; from pathlib import Path; from common.slots import claim; "
    "print(claim(Path(sys.argv[1])), flush=True); time.sleep(60)"
)


def _holder(folder: Path) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def test_copies_get_the_lowest_free_slots_and_a_dead_ones_comes_back(tmp_path: Path) -> None:
    first, slot_a = _holder(tmp_path)
    second, slot_b = _holder(tmp_path)
    try:
        assert (slot_a, slot_b) == (0, 1)
        first.kill()  # a crash: the kernel drops its lock
        first.wait()
        third, slot_c = _holder(tmp_path)
        fourth, slot_d = _holder(tmp_path)
        for process in (third, fourth):
            process.kill()
            process.wait()
        assert (slot_c, slot_d) == (0, 2)
    finally:
        for process in (first, second):
            process.kill()
            process.wait()


def _args(tmp_path: Path | None, worker_id: str, device: str) -> argparse.Namespace:
    return argparse.Namespace(worker_id=worker_id, device=device, slot_dir=tmp_path)


def test_apply_puts_the_slot_in_the_id_and_gives_a_gpu_slot_its_own_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = _args(tmp_path, "gpu-{slot}", "cuda:{slot}")
    slots.apply(args)
    assert (args.worker_id, args.device) == ("gpu-0", "cuda:0")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    args = _args(tmp_path, "gpu-{slot}", "cuda:{slot}")
    slots.apply(args)  # slot 1 of the two devices this container sees
    assert (args.worker_id, args.device, os.environ["CUDA_VISIBLE_DEVICES"]) == ("gpu-1", "cuda:0", "6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(ValueError, match="slot 2, but CUDA_VISIBLE_DEVICES names 2 devices"):
        slots.apply(_args(tmp_path, "gpu-{slot}", "cuda:{slot}"))


def test_a_plain_id_takes_no_slot_and_bad_uses_are_named(tmp_path: Path) -> None:
    args = _args(None, "worker-0", "cpu")
    slots.apply(args)
    assert (args.worker_id, args.device) == ("worker-0", "cpu")
    with pytest.raises(ValueError, match="needs --slot-dir"):
        slots.apply(_args(None, "cpu-{slot}", "cpu"))
    with pytest.raises(ValueError, match="--device takes {slot} only as cuda:{slot}"):
        slots.apply(_args(tmp_path, "w", "cuda:1{slot}"))
    assert not list(tmp_path.iterdir())  # refused before any slot was taken


def test_the_worker_command_refuses_a_slot_without_its_folder() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpu_worker", "--model", "/nonexistent", "--worker-id", "cpu-{slot}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--slot-dir" in done.stderr
