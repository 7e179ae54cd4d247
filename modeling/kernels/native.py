"""The model's CPU kernels (csrc/): attention of every row over the paged KV cache, read
in place through block tables, and the fused elementwise parts of a layer (RMSNorm with the
residual add, RoPE, SiLU-and-multiply), and the greedy token of each row of logits. Built
once per machine.

They are compiled on first use into the specserve cache, by default with the machine's own
instruction set (`-march=native`), under a name that hashes the source, the torch and Python
versions and the CPU's flags, so a cache shared with another kind of CPU never loads a
foreign build. `SPECSERVE_KERNEL_ARCH` names an x86-64 level instead (x86-64-v2, -v3, -v4):
the build then runs on any CPU of that level, which is checked before it is loaded (an image
built on one machine and run on others). A build found in the cache is loaded without a
compiler, so an image can build the kernels in a build stage and ship none; with a
compiler, a build made by another compiler is made again. `python -m modeling.kernels.native`
builds them ahead (set-up does). Where they cannot be built or loaded, or are turned off
(`SPECSERVE_NATIVE_OPS=0`), the model runs on torch ops alone, and its owner's log says why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from common.logs import configure, get_logger
from modeling.model.store import default_cache_dir

SWITCH_ENV = "SPECSERVE_NATIVE_OPS"
ARCH_ENV = "SPECSERVE_KERNEL_ARCH"
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
# The CPU flags (/proc/cpuinfo) each x86-64 level needs: a build for a level loads only on a CPU that has them all.
ARCH_LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v2": _V2,
    "x86-64-v3": _V3,
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("argmax.cpp", "attention.cpp", "elementwise.cpp", "layers.cpp", "linear.cpp", "module.cpp", "team.cpp")
# No contraction of a * b + c into one FMA: the fused ops round as torch's do. No traps assumed: loops with
# conditional float operations vectorize (the values are IEEE's either way).
_CFLAGS = ("-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
_HEADERS = ("ops.h", "linear_tiles.h", "linear_blocks.h", "team.h")


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


def kernel_arch() -> str:
    """The instruction set the kernels are built for: "native", or an x86-64 level. Raises KernelUnavailable for
    another value, or a level this CPU lacks (its code would stop the process with an illegal instruction)."""
    arch = os.environ.get(ARCH_ENV, "") or "native"
    if arch == "native":
        return arch
    if arch not in ARCH_LEVELS:
        raise KernelUnavailable(f"{ARCH_ENV}={arch!r}: the choices are native, {', '.join(ARCH_LEVELS)}")
    if missing := ARCH_LEVELS[arch] - set(_cpu_flags().split()):
        raise KernelUnavailable(f"{ARCH_ENV}={arch}: this CPU lacks {', '.join(sorted(missing))}")
    return arch


@functools.cache
def _build_name() -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_SOURCE_DIR / name).read_bytes())
    # The sources' folder too: torch writes their paths into the build file, so two
    # checkouts sharing one folder would rebuild it for each other at every start.
    # Not the compiler: a build is loaded where there is none (`compiler.txt` in its folder names it).
    arch = kernel_arch()
    for part in (
        str(_SOURCE_DIR),
        torch.__version__,
        _cpu_flags() if arch == "native" else arch,
        sys.version,
        *_CFLAGS,
    ):
        digest.update(part.encode())
    return f"specserve_native_{digest.hexdigest()[:16]}"


def _reusable(library: Path, stamp: Path, compiler: str) -> bool:
    """A build there is whole (its compiler named once it was done) and no other compiler would make it now."""
    return library.exists() and stamp.exists() and (not compiler or stamp.read_text() == compiler)


def _import_built(name: str, library: Path) -> ModuleType:
    """Load a build made earlier (torch is imported already, so the symbols it needs are there)."""
    spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, str(library)))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _load() -> ModuleType | KernelUnavailable:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return KernelUnavailable(f"turned off by {SWITCH_ENV}=0")
    try:
        arch = kernel_arch()
        name = _build_name()
    except KernelUnavailable as unavailable:
        return unavailable
    build_dir = default_cache_dir() / "kernels" / name
    library, stamp = build_dir / f"{name}.so", build_dir / "compiler.txt"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # One process builds at a time. torch's own lock is a file that a process killed
        # mid-build leaves behind, and every later load would wait on it for ever; this
        # lock goes with its process, and whoever holds it may clear torch's.
        with open(build_dir / "specserve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            compiler = _compiler_version()
            if _reusable(library, stamp, compiler):
                return _import_built(name, library)
            if not compiler:
                return KernelUnavailable(
                    f"no C++ compiler to build {_SOURCE_DIR} for {arch}, and no build of them in {build_dir}"
                )
            stamp.unlink(missing_ok=True)
            from torch.utils.cpp_extension import load

            # torch runs `ninja` from PATH; the project's own (a dependency) sits beside this Python, which a venv used
            # without being activated (`make`, `.venv/bin/specserve`) does not put on PATH.
            scripts = os.path.dirname(sys.executable)
            if scripts not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
            module: ModuleType = load(
                name=name,
                sources=[str(_SOURCE_DIR / source) for source in _SOURCES],
                extra_cflags=["-O3", f"-march={arch}", *_CFLAGS],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
            stamp.write_text(compiler)
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
    log.info("native ops ready", name=_build_name(), arch=kernel_arch())


if __name__ == "__main__":
    main()
