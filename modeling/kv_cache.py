"""The KV cache: keys and values of every layer for a fixed number of sequence slots."""

from __future__ import annotations

import torch

from modeling.config import ModelConfig


class KVCache:
    """One slot per sequence, each holding up to `max_len` positions.

    Layout `[num_layers, num_slots, num_kv_heads, max_len, head_dim]`, so the keys of a
    run of consecutive slots are one strided view (no copy) for batched attention.
    Which slots are in use, and how many positions each holds, is the owner's business
    (see `SlotTable`); the cache itself is just memory.
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len


class SlotError(ValueError):
    """A step asked for something inconsistent with what the slots hold (a protocol error)."""


class SlotTable:
    """How many positions each slot holds; empty slots hold 0.

    The scheduler decides which slot a sequence uses; this table checks every step
    against what the cache really holds, so a confused scheduler gets an error instead
    of silently attending to another sequence's keys.
    """

    def __init__(self, num_slots: int, max_len: int) -> None:
        self._lengths = [0] * num_slots
        self._max_len = max_len

    @property
    def num_used(self) -> int:
        return sum(1 for n in self._lengths if n > 0)

    def length(self, slot: int) -> int:
        self._check_slot(slot)
        return self._lengths[slot]

    def check_append(self, slot: int, start: int, num_new: int) -> None:
        """Raise SlotError unless `num_new` tokens can be written at `start` in `slot`."""
        held = self.length(slot)
        if start != held:
            raise SlotError(f"slot {slot} holds {held} positions but the step starts at {start}")
        if num_new < 1 or start + num_new > self._max_len:
            raise SlotError(f"slot {slot}: {num_new} new tokens at {start} do not fit in {self._max_len} positions")

    def set_length(self, slot: int, length: int) -> None:
        self._check_slot(slot)
        self._lengths[slot] = length

    def release(self, slot: int) -> None:
        self.set_length(slot, 0)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._lengths):
            raise SlotError(f"slot {slot} is outside 0..{len(self._lengths) - 1}")
