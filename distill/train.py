"""`specserve distill`: train an EAGLE-style draft head for a target, from the target's own outputs.

Steps: (1) the target writes requests itself, answers them and the shipped ones, and reads
local Python source, which gives tokens and the target's final hidden states
(cached in OUT/training/data.pt); (2) the head
learns to predict the next hidden state (smooth L1) and the target's next-token
distribution over the draft vocabulary (cross-entropy), with noise on its input features
so it tolerates its own errors when it chains; (3) the head is written as a draft folder
(OUT), with the exact arguments and the figures in its config.json, and beside it the
sequences the target answered as a phrase store (common/text/phrases.py), which
`--draft phrases:OUT` (and `eagle+phrases:OUT`) propose from where they match; (4) chained greedy
acceptance is measured on held-out requests through the serving engine.

The data (OUT/training/data.pt) and checkpoints (OUT/training/checkpoint.pt, written every
--checkpoint-every steps and at the end) stay apart from the draft's own files;
--resume continues from them.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common.text.phrases import PhraseStore
from common.text.tokenizer import ChatMessage, Tokenizer
from distill.arguments import DistillArgs, data_max_len
from distill.checkpoints import load_saved, save_checkpoint
from distill.data import Sequence, chunk_tokens, draft_vocabulary, generate, read_text, stdlib_sources, write_requests
from distill.objective import head_losses, training_figures
from distill.prompts import request_openings, training_prompts
from modeling.model.config import ModelConfig
from modeling.model.checkpoint import read_safetensors
from modeling.model.eagle import EagleHead
from modeling.model.engine import ModelEngine
from modeling.model.kv_cache import pages_for_slots

_DATA_SLOTS = 64  # sequences the target answers at once while it makes the data


def run(args: DistillArgs, log: Callable[[str], None] = print, stop_after: int | None = None) -> dict[str, float]:
    """Make the data (or reuse it), train, write the draft folder; returns the figures.

    `stop_after` ends the run after that step's checkpoint (an interruption, for tests).
    """
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    (args.out / "training").mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "training" / "checkpoint.pt"
    state = _resume_state(args, checkpoint) if args.resume else None  # checked before hours of data making
    started = time.monotonic()
    sequences = _data(args, log)
    data_s = time.monotonic() - started
    config = ModelConfig.from_folder(args.target)
    tensors = read_safetensors(args.target)
    vocab = draft_vocabulary(sequences, args.draft_vocab_size, config.vocab_size)
    head = EagleHead(config, tensors["model.embed_tokens.weight"], vocab)
    head.init_layer_from(tensors, config.num_layers - 1, tensors["model.norm.weight"])
    del tensors
    device = torch.device(args.device)
    head.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, history = 0, []
    resume_record = args.resume_record()  # the target's fingerprints read once, not at every checkpoint
    train, held = _split(sequences)
    rng = random.Random(args.seed)
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        rng.setstate(state["sampler"])
        log(f"resuming at step {step} of {args.steps}")
    bar = tqdm(total=args.steps, initial=step, desc="distill", unit="step", file=sys.stderr, dynamic_ncols=True)
    while step < args.steps:
        batch = rng.sample(train, min(args.batch_sequences, len(train)))
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr)
        head.train()
        reg, cls, acc = head_losses(head, batch, args.feature_noise, args.unroll)
        loss = reg + args.cls_weight * cls
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        losses = (float(reg.detach()), float(cls.detach()), float(acc))
        history.append(losses)
        bar.update(1)
        bar.set_postfix(reg=f"{losses[0]:.3f}", cls=f"{losses[1]:.3f}", top1=f"{losses[2]:.2f}")
        if step % args.checkpoint_every == 0 or step == args.steps or step == stop_after:
            save_checkpoint(
                checkpoint,
                {
                    "head": head.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "history": history,
                    "arguments": resume_record,
                    "torch_rng": torch.get_rng_state(),
                    "sampler": rng.getstate(),
                },
            )
        if step == stop_after:
            bar.close()
            return {}
    bar.close()
    figures = training_figures(head, held, history)
    head.cpu()
    figures["data_minutes"] = round(data_s / 60, 1)
    figures["total_minutes"] = round((time.monotonic() - started) / 60, 1)
    phrases = phrase_store(sequences)
    figures["phrase_tokens"] = phrases.num_tokens
    phrases.save(args.out)
    head.save(args.out, args.target, {"arguments": args.record(), "figures": figures})
    log(json.dumps(figures))
    return figures


def _resume_state(args: DistillArgs, checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint to go on from (None: there is none yet); ResumeMismatch if it was made otherwise."""
    return load_saved(checkpoint, args.resume_record(), args.device) if checkpoint.exists() else None


def phrase_store(sequences: list[Sequence]) -> PhraseStore:
    """The sequences the target answered (request and answer: its own words or its template's), not the read text."""
    return PhraseStore.from_sequences([s.tokens for s in sequences if s.first_generated < len(s.tokens)])


def _data(args: DistillArgs, log: Callable[[str], None]) -> list[Sequence]:
    path = args.out / "training" / "data.pt"
    if args.resume and path.exists():
        return [Sequence(**s) for s in load_saved(path, args.resume_data_record())["sequences"]]
    config = ModelConfig.from_folder(args.target)
    tokenizer = Tokenizer.load(args.target)
    max_len = data_max_len(config)
    engine = ModelEngine(
        args.target,
        config,
        device=args.device,
        dtype=args.dtype,
        num_pages=pages_for_slots(_DATA_SLOTS, max_len),
        max_len=max_len,
    )
    engine.load()
    engine.allocate()
    stop_ids = set(tokenizer.eos_token_ids)
    text = chunk_tokens(
        [tokenizer.encode(t) for t in stdlib_sources(args.text_tokens * 8)], min(256, max_len), args.text_tokens
    )
    bar = tqdm(
        total=args.self_prompts + args.num_prompts + args.self_prompts + len(text),
        desc="target data",
        unit="seq",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    requests = training_prompts(args.num_prompts, args.seed) + _self_written(
        engine, tokenizer, args, stop_ids, lambda: bar.update(1)
    )
    chat = tokenizer.has_chat_template
    prompts = [tokenizer.encode_chat([ChatMessage("user", r)]) if chat else tokenizer.encode(r) for r in requests]
    prompts = [p[: max_len - args.max_new_tokens - 1] for p in prompts]
    bar.total = args.self_prompts + len(prompts) + len(text)  # duplicates and empty requests were dropped
    sequences = generate(engine, prompts, args.max_new_tokens, stop_ids, lambda: bar.update(1))
    sequences += read_text(engine, text, lambda: bar.update(1))
    bar.close()
    save_checkpoint(
        path,
        {
            "arguments": args.resume_data_record(),  # ~1.4 GB: written whole or not at all
            "sequences": [
                {"tokens": s.tokens, "features": s.features, "first_generated": s.first_generated} for s in sequences
            ],
        },
    )
    log(f"target data: {len(sequences)} sequences, {sum(len(s.tokens) for s in sequences)} tokens")
    return sequences


def _self_written(
    engine: ModelEngine, tokenizer: Tokenizer, args: DistillArgs, stop_ids: set[int], on_request: Callable[[], None]
) -> list[str]:
    """`args.self_prompts` requests written by the target (distinct, non-empty; fewer when it repeats itself).

    With a chat template each starts as the template's user turn plus an opening; a
    target without one continues the openings alone, so those are never empty there.
    """
    openings = request_openings(args.self_prompts, may_be_empty=tokenizer.has_chat_template)
    prefix = ""
    if tokenizer.has_chat_template:
        marker = "\u241e"  # a character no template writes: where the user's text goes
        rendered = tokenizer.render_chat([ChatMessage("user", marker)])
        prefix = rendered[: rendered.index(marker)]
    starts = [tokenizer.encode_raw(prefix + opening) if prefix else tokenizer.encode(opening) for opening in openings]
    written_ids = write_requests(engine, starts, args.request_tokens, stop_ids, args.seed, on_request=on_request)
    requests = dict.fromkeys((opening + tokenizer.decode(ids)).strip() for opening, ids in zip(openings, written_ids))
    return [r for r in requests if r]


def _split(sequences: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """One in twenty sequences is held out for the figures (the benchmarks use prompts the command never sees)."""
    held = sequences[::20]
    train = [s for i, s in enumerate(sequences) if i % 20]
    return train or held, held


def _lr(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
