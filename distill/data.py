"""Training data for a draft head, made offline by the target itself.

Two sources, both run through the target (`ModelEngine.forward_with_features`), which
gives each position's final hidden state f_j next to the tokens:

- self-distillation: the target answers the shipped chat requests greedily, so the draft
  learns the target's own output distribution;
- local text: chunks of the Python standard library's source, read by the target
  (teacher forcing), for code.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling.batch import SeqSpan
from modeling.engine import ModelEngine


@dataclass
class Sequence:
    tokens: list[int]  # x_0 .. x_n
    features: torch.Tensor  # [n, H]: f_0 .. f_{n-1}, the target's final hidden state at each position but the last
    first_generated: int  # index of the first token the target produced (len(tokens) for read text)

    def __post_init__(self) -> None:
        if self.features.shape[0] != len(self.tokens) - 1:
            raise ValueError(f"{len(self.tokens)} tokens need {len(self.tokens) - 1} features, not {self.features.shape[0]}")


def generate(engine: ModelEngine, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             on_sequence: Callable[[], None] = lambda: None) -> list[Sequence]:
    """Greedy answers of the target to `prompts`, as many at once as the engine has slots; each with its features."""
    out: list[Sequence] = []
    for start in range(0, len(prompts), engine.num_slots):
        group = prompts[start : start + engine.num_slots]
        logits, hidden = engine.forward_with_features([SeqSpan(slot, 0, ids, 1) for slot, ids in enumerate(group)])
        tokens = [list(ids) for ids in group]
        features: list[list[torch.Tensor]] = []
        offset = 0
        for ids in group:
            features.append([hidden[offset : offset + len(ids)].clone()])
            offset += len(ids)
        next_ids = logits.argmax(-1).tolist()
        active = list(range(len(group)))
        for _ in range(max_new_tokens):
            for slot in active:
                tokens[slot].append(next_ids[slot])
            active = [s for s in active if next_ids[s] not in stop_ids and len(tokens[s]) < engine.max_len]
            if not active or len(tokens[active[0]]) - len(group[active[0]]) >= max_new_tokens:
                break
            logits, hidden = engine.forward_with_features([SeqSpan(s, len(tokens[s]) - 1, [tokens[s][-1]], 1) for s in active])
            for row, slot in enumerate(active):
                features[slot].append(hidden[row : row + 1].clone())
                next_ids[slot] = int(logits[row].argmax())
        for slot, ids in enumerate(group):
            f = torch.cat(features[slot])[: len(tokens[slot]) - 1]
            out.append(Sequence(tokens[slot], f, len(ids)))
            on_sequence()
    return out


def read_text(engine: ModelEngine, chunks: list[list[int]], on_sequence: Callable[[], None] = lambda: None) -> list[Sequence]:
    """The target's features over each chunk of text, read in one prefill each (slot 0)."""
    out: list[Sequence] = []
    for chunk in chunks:
        _, hidden = engine.forward_with_features([SeqSpan(0, 0, chunk, 1)])
        out.append(Sequence(list(chunk), hidden[: len(chunk) - 1].clone(), len(chunk)))
        on_sequence()
    return out


def stdlib_sources(limit_bytes: int) -> list[str]:
    """Python source files of the running interpreter's standard library, in a fixed order, up to `limit_bytes` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def chunk_tokens(token_lists: list[list[int]], chunk_len: int, max_tokens: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    total = 0
    for ids in token_lists:
        for start in range(0, len(ids) - chunk_len // 2, chunk_len):
            chunk = ids[start : start + chunk_len]
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_tokens:
                return chunks
    return chunks


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` token ids the draft may propose: those the data shows most often (ties by id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq.tokens, dtype=torch.long), minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)
