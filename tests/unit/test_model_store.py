"""The model store: GGUF files converted once into folders keyed by their content, named models, and `up --model`."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeling.gguf.convert import is_converted
from modeling.model.store import (
    DEFAULT_MODEL_NAME,
    MODEL_NAMES,
    UnknownModel,
    ensure_gguf_model,
    ensure_model,
    gguf_file_key,
    model_dir,
)
from specserve.cli import _build_parser
from specserve.up import UpRefused, up_config
from tests.gguf_files import Shape, TinyGguf, byte_level_vocabulary


def tiny_qwen2(path: Path, *, seed: int = 0) -> Path:
    return TinyGguf("qwen2", Shape(), byte_level_vocabulary("qwen2", add_bos=False), seed=seed).write(path)


def test_a_gguf_file_converts_once_into_a_folder_keyed_by_its_content(tmp_path: Path) -> None:
    gguf_path, cache = tiny_qwen2(tmp_path / "tiny.gguf"), tmp_path / "cache"
    folder = ensure_gguf_model(gguf_path, cache)
    assert folder == cache / "gguf" / f"tiny-{gguf_file_key(gguf_path)}" and is_converted(folder)
    converted_ns = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_gguf_model(gguf_path, cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == converted_ns  # not converted again
    assert not [path.name for path in folder.parent.iterdir() if path.name.startswith(".tiny")]  # no staging left
    tiny_qwen2(gguf_path, seed=1)  # the same name and size, other weights
    other = ensure_gguf_model(gguf_path, cache)
    assert other != folder and is_converted(other)


def test_the_file_key_follows_the_bytes_not_the_name(tmp_path: Path) -> None:
    gguf_path = tiny_qwen2(tmp_path / "a.gguf")
    copy = tmp_path / "b.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    assert gguf_file_key(copy) == gguf_file_key(gguf_path)
    data = bytearray(gguf_path.read_bytes())
    data[100] ^= 1
    copy.write_bytes(bytes(data))
    assert gguf_file_key(copy) != gguf_file_key(gguf_path)


def test_named_models(tmp_path: Path) -> None:
    assert MODEL_NAMES == (DEFAULT_MODEL_NAME, "gemma3-270m")
    assert model_dir("gemma3-270m", tmp_path) == tmp_path / "gemma3-270m"
    with pytest.raises(UnknownModel, match="no model is named 'gemma-9000'.*gemma3-270m"):
        ensure_model("gemma-9000", tmp_path)


def test_up_takes_a_gguf_file_and_serves_its_converted_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tiny_qwen2(tmp_path / "tiny.gguf")
    args = _build_parser().parse_args(["up", "--model", str(gguf_path), "--device", "cpu"])
    stack = up_config(args).stack
    assert stack.model == tmp_path / "cache" / "gguf" / f"tiny-{gguf_file_key(gguf_path)}"
    assert stack.max_model_len == 2048 and stack.draft is not None and stack.draft.kind.value == "ngram"


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ("no-such-thing", "no such file or folder, nor a named model"),
        ("{tmp}/bad.gguf", "bad.gguf: not a readable GGUF file"),
    ],
)
def test_up_refuses_a_model_it_cannot_find_or_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, reason: str
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    args = _build_parser().parse_args(["up", "--model", given.format(tmp=tmp_path), "--device", "cpu"])
    with pytest.raises(UpRefused, match=reason):
        up_config(args)
    assert not list((tmp_path / "cache").glob("gguf/bad-*"))
