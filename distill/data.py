"""Training data for a draft head, made offline by the target itself.

Two sources, both run through the target (`ModelEngine.forward_with_features`), which
gives each position's final hidden state f_j next to the tokens:

- self-distillation: the target answers chat requests greedily, so the draft learns the
  target's own output distribution. The requests are the shipped ones plus requests the
  target writes itself (`write_requests`), which vary far more;
- local text: chunks of the Python standard library's source, read by the target
  (teacher forcing), for code.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling.model.batch import SeqSpan
from modeling.model.engine import ModelEngine


@dataclass
class Sequence:
    tokens: list[int]  # x_0 .. x_n
    features: torch.Tensor  # [n, H]: f_0 .. f_{n-1}, the target's final hidden state at each position but the last
    first_generated: int  # index of the first token the target produced (len(tokens) for read text)

    def __post_init__(self) -> None:
        if self.features.shape[0] != len(self.tokens) - 1:
            raise ValueError(
                f"{len(self.tokens)} tokens need {len(self.tokens) - 1} features, not {self.features.shape[0]}"
            )


def generate(
    engine: ModelEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    on_sequence: Callable[[], None] = lambda: None,
) -> list[Sequence]:
    """Greedy answers of the target to `prompts`, as many at once as the engine has slots; each with its features."""
    out: list[Sequence] = []
    for start in range(0, len(prompts), engine.num_slots):
        group = prompts[start : start + engine.num_slots]
        tokens, features = _decode(engine, group, max_new_tokens, stop_ids, lambda logits: logits.argmax(-1), True)
        for ids, seq, feats in zip(group, tokens, features):
            out.append(Sequence(seq, torch.cat(feats)[: len(seq) - 1], len(ids)))
            on_sequence()
    return out


def write_requests(
    engine: ModelEngine,
    starts: list[list[int]],
    max_tokens: int,
    stop_ids: set[int],
    seed: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
    on_request: Callable[[], None] = lambda: None,
) -> list[list[int]]:
    """Requests the target writes itself: a sampled continuation of each start (its chat template's user turn, often
    with an opening such as "Write a Python function"), up to a stop id or `max_tokens`; the stop id is left out.

    An instruct model asked to continue an empty user turn writes the kind of requests it
    was tuned on, so the answers to these cover far more subjects than any shipped list.
    """
    generator = torch.Generator(device=engine.device).manual_seed(seed)  # on the device the logits are on

    def sample(logits: torch.Tensor) -> torch.Tensor:
        probs, ids = (logits.float() / temperature).softmax(-1).sort(-1, descending=True)
        probs[probs.cumsum(-1) - probs > top_p] = 0.0  # nucleus: the smallest set of ids holding top_p of the mass
        return ids.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)

    out: list[list[int]] = []
    for start in range(0, len(starts), engine.num_slots):
        group = starts[start : start + engine.num_slots]
        tokens, _ = _decode(engine, group, max_tokens, stop_ids, sample, False)
        for ids, seq in zip(group, tokens):
            written = seq[len(ids) :]
            out.append(written[:-1] if written and written[-1] in stop_ids else written)
            on_request()
    return out


def _decode(
    engine: ModelEngine,
    group: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    pick: Callable[[torch.Tensor], torch.Tensor],
    with_features: bool,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Continue each prompt of `group` (one slot each) with `pick`'s tokens until a stop id, `max_new_tokens` or the
    engine's length; -> the prompts with their continuations, and (with_features) the target's features by position."""
    logits, hidden = engine.forward_with_features(
        [SeqSpan(engine.slot_pages(slot), 0, ids, 1) for slot, ids in enumerate(group)]
    )
    tokens = [list(ids) for ids in group]
    features: list[list[torch.Tensor]] = [[] for _ in group]
    if with_features:
        offset = 0
        for slot, ids in enumerate(group):
            features[slot].append(hidden[offset : offset + len(ids)].cpu().clone())
            offset += len(ids)
    next_ids = pick(logits).tolist()
    active = list(range(len(group)))
    for _ in range(max_new_tokens):
        for row, slot in enumerate(active):
            tokens[slot].append(next_ids[row])
        active = [
            s for row, s in enumerate(active) if next_ids[row] not in stop_ids and len(tokens[s]) < engine.max_len
        ]
        if not active or len(tokens[active[0]]) - len(group[active[0]]) >= max_new_tokens:
            break
        logits, hidden = engine.forward_with_features(
            [SeqSpan(engine.slot_pages(s), len(tokens[s]) - 1, [tokens[s][-1]], 1) for s in active]
        )
        if with_features:
            for row, slot in enumerate(active):
                features[slot].append(hidden[row : row + 1].cpu().clone())
        next_ids = pick(logits).tolist()
    return tokens, features


def read_text(
    engine: ModelEngine, chunks: list[list[int]], on_sequence: Callable[[], None] = lambda: None
) -> list[Sequence]:
    """The target's features over each chunk of text, read in one prefill each (slot 0)."""
    out: list[Sequence] = []
    for chunk in chunks:
        _, hidden = engine.forward_with_features([SeqSpan(engine.slot_pages(0), 0, chunk, 1)])
        out.append(Sequence(list(chunk), hidden[: len(chunk) - 1].cpu().clone(), len(chunk)))
        on_sequence()
    return out


def stdlib_sources(limit_bytes: int) -> list[str]:
    """Python source files of the running interpreter's standard library,
    in a fixed order, up to `limit_bytes` in all."""
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
