"""A GGUF file's metadata, read key by key, so that a key nothing read is refused instead of dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keys that describe the file or a training run and change neither the math nor the tokens:
# names, licences, sources, the quantizer's importance-matrix notes.
_DESCRIPTIVE_PREFIXES = ("general.", "quantize.imatrix.")


class GgufConversionError(ValueError):
    """The GGUF file holds something this converter cannot represent; the message says what."""


class GgufMetadata:
    """The key-value metadata of one GGUF file; every read is remembered (`refuse_unread()` refuses the rest)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        self._read: set[str] = set()

    @property
    def arch(self) -> str:
        """general.architecture, the prefix of the model's own keys."""
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise GgufConversionError(f"general.architecture is {arch!r}, not a name")
        return arch

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        self._read.add(key)
        return self._values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._values:
            raise GgufConversionError(f"GGUF metadata lacks {key!r}")
        return self.get(key)

    def model_get(self, name: str, default: Any = None) -> Any:
        """`{arch}.{name}`, e.g. model_get("context_length") reads llama.context_length."""
        return self.get(f"{self.arch}.{name}", default)

    def model_require(self, name: str) -> Any:
        return self.require(f"{self.arch}.{name}")

    def keys_under(self, prefix: str) -> list[str]:
        """The keys that start with `prefix` (not marked read: reading them is the caller's business)."""
        return sorted(key for key in self._values if key.startswith(prefix))

    def refuse_unread(self) -> None:
        """Raise GgufConversionError naming the keys nothing read, but for the merely descriptive ones."""
        unread = [key for key in self._values if key not in self._read and not key.startswith(_DESCRIPTIVE_PREFIXES)]
        if unread:
            raise GgufConversionError(
                f"GGUF metadata key {unread[0]!r} is not understood by this converter (not understood: {unread[:8]})"
            )
