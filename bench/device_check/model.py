"""The model every stack serves (given, the store's, or seeded random weights of its shape), the environment it runs
in, and Hugging Face's greedy answers that the served tokens are compared with."""

from __future__ import annotations

import platform
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.device_check.report import Outcome
from common.text.tokenizer import ChatMessage, Tokenizer

SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
OPTIONAL_SHAPE_FILES = ("special_tokens_map.json",)
RANDOM_SEED = 0
# A float32 logit margin this small is a tie within rounding: the two orders of summation that a GPU's
# kernels and Hugging Face's take may pick either token.
TIE_MARGIN = 1e-2


def environment(device: str) -> Outcome[None]:
    details: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_file": torch.__file__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        details |= {
            "device_name": properties.name,
            "device_memory_gib": round(properties.total_memory / 2**30, 1),
            "compute_capability": f"{properties.major}.{properties.minor}",
            "num_devices": torch.cuda.device_count(),
        }
    return Outcome(device == "cpu" or torch.cuda.is_available(), details)


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    source: str  # "given", "model store" or "random weights"
    note: str


def choose_model(given: Path | None, random_weights: bool, shape_dir: Path, work_dir: Path) -> ModelChoice:
    """The folder every stack serves and Hugging Face reads: given, the store's, or random weights of its shape."""
    from modeling.gguf.convert import is_converted
    from modeling.model.store import default_model_dir

    if given is not None:
        return ModelChoice(given.resolve(), "given", "--model-dir")
    store = default_model_dir()
    if not random_weights and is_converted(store):
        return ModelChoice(store, "model store", "the embedded model's own weights")
    shape = shape_dir if (shape_dir / "config.json").is_file() else store
    return ModelChoice(
        random_model(shape, work_dir / "random-model"),
        "random weights",
        f"seed {RANDOM_SEED}, the embedded model's config and tokenizer from {shape}: greedy comparisons test "
        "the same arithmetic as the real weights would, not the text's quality",
    )


def random_model(shape_dir: Path, folder: Path) -> Path:
    """A Hugging Face Llama folder with the config and tokenizer files of `shape_dir` and seeded random weights."""
    import safetensors.torch
    import transformers

    missing = [name for name in SHAPE_FILES if not (shape_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{shape_dir} lacks {', '.join(missing)}: run `bash bench/device_check.sh --prepare` where the model "
            "store has the embedded model, or pass --model-dir"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name in SHAPE_FILES + OPTIONAL_SHAPE_FILES:
        if (shape_dir / name).is_file():
            shutil.copyfile(shape_dir / name, folder / name)
    config = transformers.LlamaConfig.from_pretrained(folder)
    torch.manual_seed(RANDOM_SEED)
    model = transformers.LlamaForCausalLM(config).float()  # Hugging Face's own initialisation, seeded
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the same tensor as the embedding: safetensors stores it once
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@dataclass(frozen=True)
class Reference:
    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]
    margins: list[float]  # Hugging Face's top-1 minus top-2 logit before each token


def references(model_dir: Path, prompts: Sequence[str], num_tokens: int, device: str) -> list[Reference]:
    """Hugging Face's greedy continuations (float32, end-of-sequence not stopping them) of the chat-templated
    prompts, with each step's top-2 margin."""
    import transformers

    tokenizer = Tokenizer.load(model_dir)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = loaded.to(device).eval()
    found = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode_chat([ChatMessage("user", prompt)])
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids], device=device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                max_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        token_ids = out.sequences[0, len(prompt_ids) :].tolist()
        if len(token_ids) != num_tokens:
            raise RuntimeError(f"Hugging Face gave {len(token_ids)} tokens, not {num_tokens} (it stopped early)")
        margins = []
        for logits in out.logits:  # [1, V] before each generated token
            top2 = torch.topk(logits[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        found.append(Reference(prompt, prompt_ids, token_ids, margins))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return found


def compare(reference: Reference, served: list[int]) -> dict[str, Any]:
    """Where the served tokens first leave Hugging Face's, and whether that is a tie within rounding there."""
    differs_at = next((i for i, (a, b) in enumerate(zip(reference.token_ids, served)) if a != b), None)
    if differs_at is None:
        if len(served) == len(reference.token_ids):
            return {"verdict": "equal"}
        return {"verdict": "differs", "num_served": len(served), "why": "the answer's length (ignore_eos)"}
    margin = reference.margins[differs_at]
    return {
        "verdict": "tie" if margin <= TIE_MARGIN else "differs",
        "first_difference": differs_at,
        "hf_margin": margin,
        "hf_token": reference.token_ids[differs_at],
        "served_token": served[differs_at],
    }
