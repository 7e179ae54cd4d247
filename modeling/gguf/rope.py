"""The `llama3` RoPE scaling that a Llama 3.1-style GGUF's `rope_freqs.weight` divisors describe.

llama.cpp does not write Llama 3.1's rope_scaling as metadata; its converter computes what
the scaling does to each frequency and stores that as a tensor: frequency i is divided by
d_i, where, with wavelength w_i = 2 pi / f_i and s_i = (L / w_i - lf) / (hf - lf),

    d_i = 1                              for w_i < L / hf   (high frequencies kept)
    d_i = factor                         for w_i > L / lf   (low frequencies interpolated)
    d_i = 1 / ((1 - s_i) / factor + s_i) between            (a smooth blend)

(L: original_max_position_embeddings, lf/hf: low/high_freq_factor). The divisors fix only
factor, L / lf and L / hf, not L itself, so the standard spelling is chosen: lf = 1, L the
low wavelength bound, hf = L over the high one. Whatever is chosen must reproduce every
divisor within 1e-6 relative, or the file is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from modeling.gguf.metadata import GgufConversionError

RELATIVE_TOLERANCE = 1e-6
_LLAMA31 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_scaling(
    divisors: np.ndarray, theta: float, head_dim: int, *, tensor_name: str
) -> dict[str, Any] | None:
    """transformers' llama3 rope parameters (beside rope_theta) that give these divisors; None when all are 1."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)  # [head_dim / 2]
    if divisors.shape != (head_dim // 2,):
        raise GgufConversionError(
            f"GGUF tensor {tensor_name!r} has {divisors.size} values for a head width of "
            f"{head_dim} (expected {head_dim // 2})"
        )
    if _reproduces(divisors, np.ones_like(divisors)):
        return None
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim / 2]
    for candidate in _candidates(divisors, wavelengths):
        if _reproduces(divisors, llama3_divisors(candidate, wavelengths)):
            return {"rope_type": "llama3", **candidate}
    raise GgufConversionError(
        f"GGUF tensor {tensor_name!r} holds RoPE frequency divisors that no llama3 scaling "
        f"reproduces (range {divisors.min():g} to {divisors.max():g})"
    )


def llama3_divisors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """What each frequency is divided by under a llama3 scaling (llama.cpp's rope_freqs values)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelengths - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, blended))


def _candidates(divisors: np.ndarray, wavelengths: np.ndarray) -> Iterator[dict[str, Any]]:
    """Scalings to try: the one the blended divisors imply (when there are two or more), then Llama 3.1's."""
    factor = float(divisors.max())
    blended = (divisors > 1.0 + RELATIVE_TOLERANCE) & (divisors < factor * (1.0 - RELATIVE_TOLERANCE))
    if np.count_nonzero(blended) >= 2:
        # s is linear in 1 / w: s = a / w + b, with a = L / (hf - lf) and b = -lf / (hf - lf).
        smooth = (1.0 / divisors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelengths[blended], smooth, 1)
        if slope > 0 and intercept < 0:  # lf > 0 and hf > lf; anything else is no llama3 scaling
            low_bound, high_bound = -slope / intercept, slope / (1.0 - intercept)  # wavelengths where s is 0 and 1
            original = round(low_bound)
            for digits in (4, 8):
                yield {
                    "factor": factor,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": round(original / high_bound, digits),
                    "original_max_position_embeddings": original,
                }
    yield {"factor": factor, **_LLAMA31}


def _reproduces(expected: np.ndarray, found: np.ndarray) -> bool:
    return bool(np.all(np.abs(found - expected) <= RELATIVE_TOLERANCE * np.abs(expected)))
