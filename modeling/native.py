"""The model's CPU kernels (csrc/): attention of every row over the paged KV cache, read
in place through block tables, and the fused elementwise parts of a layer (RMSNorm with the
residual add, RoPE, SiLU-and-multiply). Built once per machine.

They are compiled on first use with the machine's own instruction set (`-march=native`)
into the specserve cache, under a name that hashes the source, the torch version and the
CPU's flags, so a cache shared with another kind of CPU never loads a foreign build.
`python -m modeling.native` builds them ahead (set-up does). Where they cannot be built
(no C++ compiler) or are turned off (`SPECSERVE_NATIVE_OPS=0`), the model runs on torch
ops alone, and its owner's log says why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from common.logs import configure, get_logger
from modeling.model_store import default_cache_dir

SWITCH_ENV = "SPECSERVE_NATIVE_OPS"
_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("attention.cpp", "elementwise.cpp", "linear.cpp", "module.cpp")
_HEADERS = ("ops.h", "linear_tiles.h")


class KernelUnavailable(RuntimeError):
    """The kernels are turned off, or could not be built here; the message says which."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version() -> str:
    """The C++ compiler's own description (a new compiler means a new build); "" when there is none."""
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


@functools.cache
def _build_name() -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_SOURCE_DIR / name).read_bytes())
    # The sources' folder too: torch writes their paths into the build file, so two
    # checkouts sharing one folder would rebuild it for each other at every start.
    for part in (str(_SOURCE_DIR), torch.__version__, _cpu_flags(), sys.version, _compiler_version()):
        digest.update(part.encode())
    return f"specserve_native_{digest.hexdigest()[:16]}"


@functools.cache
def _load() -> ModuleType | KernelUnavailable:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return KernelUnavailable(f"turned off by {SWITCH_ENV}=0")
    name = _build_name()
    build_dir = default_cache_dir() / "kernels" / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load

        # torch runs `ninja` from PATH; the project's own (a dependency) sits beside this Python, which a venv used
        # without being activated (`make`, `.venv/bin/specserve`) does not put on PATH.
        scripts = os.path.dirname(sys.executable)
        if scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")

        # One process builds at a time. torch's own lock is a file that a process killed
        # mid-build leaves behind, and every later load would wait on it for ever; this
        # lock goes with its process, and whoever holds it may clear torch's.
        with open(build_dir / "specserve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            module: ModuleType = load(
                name=name,
                sources=[str(_SOURCE_DIR / source) for source in _SOURCES],
                # No contraction of a * b + c into one FMA: the fused ops round as torch's do.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # a missing compiler or ninja surfaces as several exception types
        return KernelUnavailable(f"could not build {_SOURCE_DIR}: {type(exc).__name__}: {str(exc).strip()[-400:]}")
    return module


def native_ops() -> ModuleType:
    """The built module (see csrc/module.cpp); raises KernelUnavailable saying why not."""
    loaded = _load()
    if isinstance(loaded, KernelUnavailable):
        raise loaded
    return loaded


def main() -> None:
    """Build the kernels ahead of the first worker start (set-up runs this)."""
    configure("native")
    log = get_logger(module="native")
    try:
        native_ops()
    except KernelUnavailable as exc:
        log.warning("native ops unavailable; the model will run on torch ops alone", reason=str(exc))
        return
    log.info("native ops ready", name=_build_name())


if __name__ == "__main__":
    main()
