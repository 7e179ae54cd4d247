"""The machine a benchmark ran on, as its JSON report records it: CPU, torch, dtype, device, platform."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any


def describe_machine(dtype: str | None, device: str | None) -> dict[str, Any]:
    return {
        "cpu_model": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "num_cpus_usable": len(os.sched_getaffinity(0)),
        "torch_version": _package_version("torch"),
        "dtype": dtype,
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    models = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return models[0] if models else None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
