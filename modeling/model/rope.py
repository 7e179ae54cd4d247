"""Rotary position embeddings as Hugging Face configs describe them: plain, and the scaled kinds of Llama-family models.

A `Rope` is read from one RoPE parameter object of config.json (transformers 5's
`rope_parameters`, or the older `rope_scaling` beside a top-level `rope_theta`). Each kind
computes the inverse frequencies (and for YaRN a factor on cos and sin) the way
transformers' own RoPE initialisation does, in float32:

- `default`: 1 / theta^(2i/D);
- `linear`: divided by `factor` (positions interpolated);
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between;
- `yarn`: a ramp between interpolated and extrapolated frequencies, cos and sin scaled by
  the attention factor;
- `dynamic` (NTK): transformers raises the base only once a sequence outgrows
  `max_position_embeddings`, recomputing it from the longest sequence in the batch, which a
  server holding other sequences' cached keys cannot reproduce. Up to
  `max_position_embeddings` it is exactly plain RoPE, so it is served up to there and a
  longer `--max-model-len` is refused (`positions_limit`).

Any parameter a kind does not take, or a kind not listed, is refused with its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


class RopeError(ValueError):
    """A RoPE parameter object this code cannot reproduce; the message names the key."""


# The parameters each kind takes, beyond rope_type/type and rope_theta (transformers' names).
_KIND_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}


@dataclass(frozen=True)
class Rope:
    theta: float
    kind: str = "default"
    # The kind's parameters, as read (None: not given).
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    max_position_embeddings: int = 0  # the model's (YaRN without a factor, and dynamic's limit, read it)

    @classmethod
    def from_hf(cls, where: str, value: dict[str, Any], theta: float, max_position_embeddings: int) -> Rope:
        """`value` is the parameter object found at config.json's `where` (named in errors)."""
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in _KIND_KEYS:
            raise RopeError(
                f"config.json {where}.rope_type {kind!r} is not supported (supported: {sorted(_KIND_KEYS)})"
            )
        others = sorted(set(value) - {"rope_type", "type", "rope_theta"} - _KIND_KEYS[kind])
        if others:
            raise RopeError(f"config.json {where} has {others[0]!r}, which rope_type {kind!r} does not take")
        missing = [key for key in _REQUIRED.get(kind, ()) if value.get(key) is None]
        if missing:
            raise RopeError(f"config.json {where} lacks {missing[0]!r}, which rope_type {kind!r} needs")

        def number(key: str) -> float | None:
            return None if value.get(key) is None else float(value[key])

        original = value.get("original_max_position_embeddings")
        rope = cls(
            theta=theta,
            kind=kind,
            factor=number("factor"),
            low_freq_factor=number("low_freq_factor"),
            high_freq_factor=number("high_freq_factor"),
            original_max_position_embeddings=None if original is None else int(original),
            attention_factor=number("attention_factor"),
            beta_fast=number("beta_fast"),
            beta_slow=number("beta_slow"),
            mscale=number("mscale"),
            mscale_all_dim=number("mscale_all_dim"),
            truncate=bool(value.get("truncate", True)),
            max_position_embeddings=max_position_embeddings,
        )
        if kind == "llama3" and rope.low_freq_factor == rope.high_freq_factor:
            raise RopeError(f"config.json {where} has low_freq_factor equal to high_freq_factor")
        return rope

    @property
    def positions_limit(self) -> int | None:
        """The most positions this RoPE is served for (None: no limit of its own)."""
        return self.max_position_embeddings if self.kind == "dynamic" else None

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 `[head_dim / 2]`."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        plain = 1.0 / (self.theta**exponents)
        if self.kind in ("default", "dynamic"):
            return plain
        if self.kind == "linear":
            assert self.factor is not None
            return plain / self.factor
        if self.kind == "llama3":
            return self._llama3(plain)
        return self._yarn(head_dim)

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (only YaRN has one)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        factor = self._yarn_factor()
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim))
        return _yarn_mscale(factor)

    def _llama3(self, plain: torch.Tensor) -> torch.Tensor:
        assert self.factor and self.low_freq_factor and self.high_freq_factor and self.original_max_position_embeddings
        factor, low, high, context = (
            self.factor,
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        )
        wavelength = 2 * math.pi / plain
        scaled = torch.where(wavelength > context / low, plain / factor, plain)
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < context / high) * ~(wavelength > context / low)
        return torch.where(medium, blended, scaled)

    def _yarn_factor(self) -> float:
        if self.factor is not None:
            return self.factor
        assert self.original_max_position_embeddings
        return self.max_position_embeddings / self.original_max_position_embeddings

    def _yarn(self, head_dim: int) -> torch.Tensor:
        assert self.original_max_position_embeddings
        factor = self._yarn_factor()
        fast = self.beta_fast or 32.0
        slow = self.beta_slow or 1.0
        base, context = self.theta, self.original_max_position_embeddings

        def dimension(rotations: float) -> float:
            """The dimension whose wavelength fits `rotations` times into the original context."""
            return (head_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = dimension(fast), dimension(slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of width 0 would divide by 0
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        powers = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
        keep = 1 - ramp  # 1 where the frequency is extrapolated (kept), 0 where it is interpolated
        return interpolated * (1 - keep) + extrapolated * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(rope: Rope, head_dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[length, head_dim]` for positions 0..length-1, in rotate-half layout."""
    limit = rope.positions_limit
    if limit is not None and length > limit:
        raise RopeError(
            f"rope_type {rope.kind!r} is served up to max_position_embeddings ({limit}) positions, not {length}"
        )
    inv_freq = rope.inv_freq(head_dim).to(device)
    freqs = torch.outer(torch.arange(length, device=device).float(), inv_freq)  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    scaling = rope.attention_scaling
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's rotate-half layout: x `[..., D]` with cos/sin broadcast to it (here `[N, 1, D]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
