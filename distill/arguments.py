"""The arguments of `specserve distill`: its flags, their checks, and the records that say which run made a result."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.arguments import not_positive_problem
from distill.prompts import training_prompts
from modeling.model.config import ModelConfig, model_fingerprint, vocab_fingerprint
from modeling.model.eagle import unsupported_target


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
        return {
            k: str(v) if isinstance(v, Path) else v
            for k, v in asdict(self).items()
            if k not in ("out", "resume", "num_threads", "device")
        }

    def data_record(self) -> dict[str, object]:
        """The arguments that decide the training data."""
        record = self.record()
        return {
            k: record[k]
            for k in (
                "target",
                "dtype",
                "num_prompts",
                "self_prompts",
                "request_tokens",
                "max_new_tokens",
                "text_tokens",
                "seed",
            )
        }

    def resume_record(self) -> dict[str, object]:
        """What --resume checks: the arguments that decide the result, with the target by its fingerprints (the same
        model under another path is the same target; another model under the same path is not)."""
        record = {k: v for k, v in self.record().items() if k != "checkpoint_every"}  # how often changes no result
        return {**record, "target": _target_identity(self.target)}

    def resume_data_record(self) -> dict[str, object]:
        return {**self.data_record(), "target": _target_identity(self.target)}


def _target_identity(target: Path) -> str:
    return f"model {model_fingerprint(target)}, vocabulary {vocab_fingerprint(target)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillArgs(Path(), Path())
    parser.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder")
    parser.add_argument(
        "--out", type=Path, required=True, help="the draft folder to write (data and checkpoints go there too)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="the target's dtype while it makes the data"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=d.num_prompts, help="shipped chat requests the target answers"
    )
    parser.add_argument(
        "--self-prompts",
        type=int,
        default=d.self_prompts,
        help="requests the target writes itself (sampled from its chat template's user turn) and then answers",
    )
    parser.add_argument("--request-tokens", type=int, default=d.request_tokens, help="the longest self-written request")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="the longest answer")
    parser.add_argument(
        "--text-tokens", type=int, default=d.text_tokens, help="tokens of local Python source the target reads"
    )
    parser.add_argument(
        "--draft-vocab-size", type=int, default=d.draft_vocab_size, help="the ids the draft may propose"
    )
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-sequences", type=int, default=d.batch_sequences)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument(
        "--feature-noise",
        type=float,
        default=d.feature_noise,
        help="std of the noise on input features, relative to their RMS",
    )
    parser.add_argument(
        "--cls-weight",
        type=float,
        default=d.cls_weight,
        help="weight of the next-token loss against the feature regression (EAGLE used 0.1)",
    )
    parser.add_argument(
        "--unroll",
        type=int,
        default=d.unroll,
        help="draft steps trained per position: step 2 reads the head's own step-1 prediction, as when it chains",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/training/checkpoint.pt and reuse OUT/training/data.pt (made with the same arguments)",
    )
    parser.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--device",
        default=None,
        help="where the target makes the data and the head trains: cpu, or cuda[:N] (default: cuda when "
        "there is a GPU, else cpu)",
    )


def check_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> DistillArgs:
    if problem := not_positive_problem(
        ns,
        (
            "num_prompts",
            "request_tokens",
            "max_new_tokens",
            "draft_vocab_size",
            "steps",
            "batch_sequences",
            "checkpoint_every",
            "unroll",
        ),
    ):
        parser.error(problem)
    if (
        ns.text_tokens < 0
        or ns.self_prompts < 0
        or not ns.lr > 0
        or not ns.feature_noise >= 0
        or not ns.cls_weight >= 0
    ):
        parser.error("--text-tokens, --self-prompts, --feature-noise and --cls-weight must be >= 0 and --lr > 0")
    if not (ns.target / "config.json").exists():
        parser.error(f"--target {ns.target}: no config.json there")
    config = ModelConfig.from_folder(ns.target)
    if problem := unsupported_target(config):
        parser.error(f"--target {ns.target}: {problem}")
    if ns.out.resolve() == ns.target.resolve():
        parser.error("--out must not be --target: the draft's files would replace the target's")
    longest = data_max_len(config) - 1 - _MIN_PROMPT_TOKENS
    if ns.max_new_tokens > longest:
        parser.error(
            f"--max-new-tokens {ns.max_new_tokens}: at most {longest} with this target (its "
            f"{data_max_len(config)} positions hold the request too)"
        )
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


def data_max_len(config: ModelConfig) -> int:
    """The longest sequence the target makes data with."""
    return min(config.max_position_embeddings, 1024)
