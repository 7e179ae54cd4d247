"""`specserve distill`: train an EAGLE-style draft head for a target, from the target's own outputs.

Steps: (1) the target writes requests itself, answers them and the shipped ones, and reads
local Python source, which gives tokens and the target's final hidden states (cached in OUT/training/data.pt); (2) the head
learns to predict the next hidden state (smooth L1) and the target's next-token
distribution over the draft vocabulary (cross-entropy), with noise on its input features
so it tolerates its own errors when it chains; (3) the head is written as a draft folder
(OUT), with the exact arguments and the figures in its config.json, and beside it the
sequences the target answered as a phrase store (modeling/phrases.py), which
`--draft phrases:OUT` (and `eagle+phrases:OUT`) propose from where they match; (4) chained greedy
acceptance is measured on held-out requests through the serving engine.

The data (OUT/training/data.pt) and checkpoints (OUT/training/checkpoint.pt, written every
--checkpoint-every steps and at the end) stay apart from the draft's own files;
--resume continues from them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from distill.data import Sequence, chunk_tokens, draft_vocabulary, generate, read_text, stdlib_sources, write_requests
from distill.prompts import request_openings, training_prompts
from common.arguments import not_positive_problem
from modeling.tokenizer import ChatMessage, Tokenizer
from modeling.config import ModelConfig, model_fingerprint, vocab_fingerprint
from modeling.eagle import EagleHead, unsupported_target
from modeling.engine import ModelEngine
from modeling.kv_cache import pages_for_slots
from modeling.llama import read_safetensors
from modeling.phrases import PhraseStore


@dataclass(frozen=True)
class DistillArgs:
    target: Path
    out: Path
    dtype: str = "bfloat16"
    num_prompts: int = 800
    self_prompts: int = 4000
    request_tokens: int = 96
    max_new_tokens: int = 192
    text_tokens: int = 60_000
    draft_vocab_size: int = 8192
    steps: int = 900
    batch_sequences: int = 16
    lr: float = 1e-3
    feature_noise: float = 0.1
    cls_weight: float = 0.5
    unroll: int = 3
    seed: int = 0
    checkpoint_every: int = 100
    resume: bool = False
    num_threads: int = 0
    device: str = "cpu"  # where the target makes the data and the head trains: cpu, or cuda[:N]

    def record(self) -> dict[str, object]:
        """The arguments that decide the result (recorded in the draft's config.json)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()
                if k not in ("out", "resume", "num_threads", "device")}

    def data_record(self) -> dict[str, object]:
        """The arguments that decide the training data."""
        record = self.record()
        return {k: record[k] for k in ("target", "dtype", "num_prompts", "self_prompts", "request_tokens", "max_new_tokens", "text_tokens", "seed")}

    def resume_record(self) -> dict[str, object]:
        """What --resume checks: the arguments that decide the result, with the target by its fingerprints (the same
        model under another path is the same target; another model under the same path is not)."""
        record = {k: v for k, v in self.record().items() if k != "checkpoint_every"}  # how often changes no result
        return {**record, "target": _target_identity(self.target)}

    def resume_data_record(self) -> dict[str, object]:
        return {**self.data_record(), "target": _target_identity(self.target)}


def _target_identity(target: Path) -> str:
    return f"model {model_fingerprint(target)}, vocabulary {vocab_fingerprint(target)}"


_DATA_SLOTS = 64  # sequences the target answers at once while it makes the data


class ResumeMismatch(ValueError):
    """--resume found data or a checkpoint made with other arguments."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillArgs(Path(), Path())
    parser.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", type=Path, required=True, help="the draft folder to write (data and checkpoints go there too)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="the target's dtype while it makes the data")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts, help="shipped chat requests the target answers")
    parser.add_argument("--self-prompts", type=int, default=d.self_prompts,
                        help="requests the target writes itself (sampled from its chat template's user turn) and then answers")
    parser.add_argument("--request-tokens", type=int, default=d.request_tokens, help="the longest self-written request")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="the longest answer")
    parser.add_argument("--text-tokens", type=int, default=d.text_tokens, help="tokens of local Python source the target reads")
    parser.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size, help="the ids the draft may propose")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-sequences", type=int, default=d.batch_sequences)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--feature-noise", type=float, default=d.feature_noise,
                        help="std of the noise on input features, relative to their RMS")
    parser.add_argument("--cls-weight", type=float, default=d.cls_weight,
                        help="weight of the next-token loss against the feature regression (EAGLE used 0.1)")
    parser.add_argument("--unroll", type=int, default=d.unroll,
                        help="draft steps trained per position: step 2 reads the head's own step-1 prediction, as when it chains")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/training/checkpoint.pt and reuse OUT/training/data.pt (made with the same arguments)")
    parser.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default=None,
                        help="where the target makes the data and the head trains: cpu, or cuda[:N] (default: cuda when "
                             "there is a GPU, else cpu)")


def check_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> DistillArgs:
    if problem := not_positive_problem(ns, ("num_prompts", "request_tokens", "max_new_tokens", "draft_vocab_size", "steps",
                                            "batch_sequences", "checkpoint_every", "unroll")):
        parser.error(problem)
    if ns.text_tokens < 0 or ns.self_prompts < 0 or not ns.lr > 0 or not ns.feature_noise >= 0 or not ns.cls_weight >= 0:
        parser.error("--text-tokens, --self-prompts, --feature-noise and --cls-weight must be >= 0 and --lr > 0")
    if not (ns.target / "config.json").exists():
        parser.error(f"--target {ns.target}: no config.json there")
    config = ModelConfig.from_folder(ns.target)
    if problem := unsupported_target(config):
        parser.error(f"--target {ns.target}: {problem}")
    if ns.out.resolve() == ns.target.resolve():
        parser.error("--out must not be --target: the draft's files would replace the target's")
    longest = _max_len(config) - 1 - _MIN_PROMPT_TOKENS
    if ns.max_new_tokens > longest:
        parser.error(f"--max-new-tokens {ns.max_new_tokens}: at most {longest} with this target (its "
                     f"{_max_len(config)} positions hold the request too)")
    try:
        training_prompts(ns.num_prompts, ns.seed)
    except ValueError as error:
        parser.error(f"--num-prompts {ns.num_prompts}: {error}")
    if ns.num_threads < 0:
        parser.error(f"--num-threads must be at least 0, got {ns.num_threads}")
    ns.device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (ns.device == "cpu" or (ns.device.startswith("cuda") and torch.cuda.is_available())):
        parser.error(f"--device {ns.device}: expected cpu, or cuda[:N] on a machine with a GPU")
    return DistillArgs(**{k: v for k, v in vars(ns).items() if k in DistillArgs.__dataclass_fields__})  # type: ignore[arg-type]


_MIN_PROMPT_TOKENS = 64  # a request keeps at least this much room beside the longest answer


def _max_len(config: ModelConfig) -> int:
    """The longest sequence the target makes data with."""
    return min(config.max_position_embeddings, 1024)


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
        reg, cls, acc = _losses(head, batch, args.feature_noise, args.unroll)
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
            _save_checkpoint(checkpoint, {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                          "history": history, "arguments": resume_record,
                                          "torch_rng": torch.get_rng_state(), "sampler": rng.getstate()})
        if step == stop_after:
            bar.close()
            return {}
    bar.close()
    figures = _figures(head, held, history)
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
    return _load_saved(checkpoint, args.resume_record(), args.device) if checkpoint.exists() else None


def _load_saved(path: Path, wanted: dict[str, object], map_location: str = "cpu") -> dict[str, Any]:
    """What --resume reuses (data or a checkpoint); ResumeMismatch, naming each difference, unless it can be read and
    was made with the `wanted` arguments."""
    try:
        saved: dict[str, Any] = torch.load(path, weights_only=False, map_location=map_location)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: say which, not a pickle trace
        raise ResumeMismatch(f"{path} cannot be read ({type(error).__name__}: {error}); delete it to start over") from error
    recorded = saved.get("arguments")
    if recorded != wanted:
        given = recorded if isinstance(recorded, dict) else {}
        differ = [f"{k}: {given.get(k)!r} there, {wanted.get(k)!r} now" for k in sorted(set(given) | set(wanted))
                  if given.get(k) != wanted.get(k)]
        raise ResumeMismatch(f"{path} was made with other arguments ({'; '.join(differ)}); run with them, or delete it "
                             "to start over")
    return saved


def phrase_store(sequences: list[Sequence]) -> PhraseStore:
    """The sequences the target answered (request and answer: its own words or its template's), not the read text."""
    return PhraseStore.from_sequences([s.tokens for s in sequences if s.first_generated < len(s.tokens)])


def _data(args: DistillArgs, log: Callable[[str], None]) -> list[Sequence]:
    path = args.out / "training" / "data.pt"
    if args.resume and path.exists():
        return [Sequence(**s) for s in _load_saved(path, args.resume_data_record())["sequences"]]
    config = ModelConfig.from_folder(args.target)
    tokenizer = Tokenizer.load(args.target)
    max_len = _max_len(config)
    engine = ModelEngine(args.target, config, device=args.device, dtype=args.dtype, num_pages=pages_for_slots(_DATA_SLOTS, max_len),
                         max_len=max_len)
    engine.load()
    engine.allocate()
    stop_ids = set(tokenizer.eos_token_ids)
    text = chunk_tokens([tokenizer.encode(t) for t in stdlib_sources(args.text_tokens * 8)], min(256, max_len), args.text_tokens)
    bar = tqdm(total=args.self_prompts + args.num_prompts + args.self_prompts + len(text), desc="target data", unit="seq",
               file=sys.stderr, dynamic_ncols=True)
    requests = training_prompts(args.num_prompts, args.seed) + _self_written(engine, tokenizer, args, stop_ids, lambda: bar.update(1))
    chat = tokenizer.has_chat_template
    prompts = [tokenizer.encode_chat([ChatMessage("user", r)]) if chat else tokenizer.encode(r) for r in requests]
    prompts = [p[: max_len - args.max_new_tokens - 1] for p in prompts]
    bar.total = args.self_prompts + len(prompts) + len(text)  # duplicates and empty requests were dropped
    sequences = generate(engine, prompts, args.max_new_tokens, stop_ids, lambda: bar.update(1))
    sequences += read_text(engine, text, lambda: bar.update(1))
    bar.close()
    _save_checkpoint(path, {"arguments": args.resume_data_record(),  # ~1.4 GB: written whole or not at all
                            "sequences": [{"tokens": s.tokens, "features": s.features, "first_generated": s.first_generated}
                                          for s in sequences]})
    log(f"target data: {len(sequences)} sequences, {sum(len(s.tokens) for s in sequences)} tokens")
    return sequences


def _self_written(engine: ModelEngine, tokenizer: Tokenizer, args: DistillArgs, stop_ids: set[int],
                  on_request: Callable[[], None]) -> list[str]:
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


def _pad(batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input features `[B, T, H]` (f_0..f_{T-1}), next tokens `[B, T]` (x_1..x_T), target features (f_1..f_T), mask `[B, T]`."""
    t = max(len(s.tokens) - 2 for s in batch)
    h = batch[0].features.shape[1]
    feats = torch.zeros(len(batch), t, h)
    targets = torch.zeros(len(batch), t, h)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.tokens) - 2  # pairs (f_j, x_{j+1}) whose next feature f_{j+1} is known
        if n <= 0:
            continue
        f = s.features.float()
        feats[i, :n] = f[:n]
        targets[i, :n] = f[1 : n + 1]
        tokens[i, :n] = torch.tensor(s.tokens[1 : n + 1])
        mask[i, :n] = True
    return feats, tokens, targets, mask


def _losses(head: EagleHead, batch: list[Sequence], noise: float, unroll: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feature regression, next-token cross-entropy and top-1 agreement (of the first step), averaged over `unroll` steps.

    Step 1 reads the target's features; step d reads, at every position j > 0, what
    step d-1 predicted for f_j: the input a chained draft token sees.
    """
    feats, tokens, targets, mask = _pad(batch)
    if noise > 0 and head.training:  # drawn on the CPU whatever the device: one random stream, the same resumed
        scale = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + torch.randn_like(feats) * scale * noise
    device = head.fc.device
    feats, tokens, targets, mask = feats.to(device), tokens.to(device), targets.to(device), mask.to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        teacher = head.draft_logits(targets).float()[mask]
    p = teacher.softmax(-1)
    regs, clss = [], []
    acc = torch.tensor(0.0)
    inputs = feats
    for depth in range(unroll):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            predicted = head(inputs, tokens)
            student = head.draft_logits(predicted).float()[mask]
        predicted = predicted.float()
        regs.append(F.smooth_l1_loss(predicted[mask], targets[mask]))
        clss.append(-(p * student.log_softmax(-1)).sum(-1).mean())
        if depth == 0:
            acc = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
        inputs = torch.cat((feats[:, :1], predicted[:, :-1]), dim=1)
    return torch.stack(regs).mean(), torch.stack(clss).mean(), acc


def _figures(head: EagleHead, held: list[Sequence], history: list[tuple[float, float, float]]) -> dict[str, float]:
    head.eval()
    with torch.no_grad():
        reg, cls, acc = _losses(head, held, 0.0) if held else (torch.tensor(0.0),) * 3
    first = history[: max(1, len(history) // 20)]
    last = history[-max(1, len(history) // 20) :]
    return {
        "steps": len(history),
        "train_cls_first": round(sum(h[1] for h in first) / len(first), 4),
        "train_cls_last": round(sum(h[1] for h in last) / len(last), 4),
        "held_out_reg": round(float(reg), 4),
        "held_out_cls": round(float(cls), 4),
        "held_out_top1": round(float(acc), 4),
    }


def _save_checkpoint(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
