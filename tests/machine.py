"""Which machine a test ran on, for reports that must say so."""

from __future__ import annotations

import os
from pathlib import Path

from modeling.kernels.native import KernelUnavailable, native_ops


def cpu_description() -> str:
    """This machine's processor and the native linear kernel's paths on it, for a report that must say where it ran:
    the suite runs on whatever CPU the machine has, and a kernel's bits may depend on it."""
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        "an unknown processor",
    )
    try:
        paths = ", ".join(native_ops().linear_paths())
    except KernelUnavailable as unavailable:
        paths = f"none ({unavailable})"
    return f"{model}; {os.cpu_count()} CPUs; linear kernel paths: {paths}"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
