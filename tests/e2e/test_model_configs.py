"""Model folders saved by the installed transformers, through the whole stack: their settings read, not guessed.

A tiny random model of every supported family (Llama 3 with its RoPE scaling, Mistral
with a sliding window, Qwen2, Qwen3, Gemma 3) must decode greedily exactly as transformers
does and sample reproducibly with a seed; one whose RoPE scaling this server does not
implement must be refused before anything starts, naming it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from proto import specserve_pb2 as pb
from specserve.stack import StackConfig, free_ports
from tests.e2e.stack import running_stack

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 24
PROMPTS = [[1, 504, 3278, 314, 253, 1345, 28], [17, 17, 17, 4123, 99], list(range(200, 260))]


def _tiny_llama(folder: Path, default_model_dir: Path, **settings: object) -> transformers.LlamaForCausalLM:
    """Random weights, the default model's vocabulary (so the gateway has its tokenizer), saved by transformers."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **settings,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return model


FAMILIES = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 20, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def _tiny_of_family(folder: Path, default_model_dir: Path, family: str) -> Any:
    """A random model of the family with the default model's vocabulary (the gateway needs a tokenizer), saved."""
    kind, settings = FAMILIES[family]
    config = getattr(transformers, kind)(
        **{
            "vocab_size": 49152,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            **settings,
        }
    )
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return model


def _greedy(reference: Any, prompt: list[int]) -> list[int]:
    """transformers' forward pass, greedily, cut after the first near-tie of the top two logits."""
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            scores = reference(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(scores.argmax()))
            top = torch.topk(scores, 2).values
            if float(top[0] - top[1]) < 1e-4:
                break
    return sequence[len(prompt) :]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_through_the_stack_as_transformers_does(
    family: str, default_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / f"tiny-{family}"
    reference = _tiny_of_family(folder, default_model_dir, family)
    expected = [_greedy(reference, prompt) for prompt in PROMPTS]
    assert sum(len(tokens) for tokens in expected) >= NUM_TOKENS  # the comparison is not empty
    (tmp_path / "logs").mkdir()
    with running_stack(StackConfig(folder, dtype="float32", max_num_seqs=4), tmp_path / "logs") as stack:
        for prompt, tokens in zip(PROMPTS, expected):
            params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
            result = stack.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params))
            assert result.token_ids[: len(tokens)] == tokens, (
                f"{family}, prompt {prompt[:4]}...: ours differ from transformers'"
            )
        sampled = []
        for seed in (7, 7, 8):
            params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
            sampled.append(
                list(stack.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[0]), params=params)).token_ids)
            )
        assert sampled[0] == sampled[1], f"{family}: one seed, two different samples"
        assert sampled[0] != sampled[2], f"{family}: another seed, the same sample"


def test_a_rope_scaling_it_does_not_implement_is_refused_before_anything_starts(
    default_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "tiny-llama-longrope"
    _tiny_llama(folder, default_model_dir, rope_theta=500000.0)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    (folder / "config.json").write_text(json.dumps(config))
    grpc_port, http_port = free_ports(2)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "up",
            "--model",
            str(folder),
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "rope_parameters.rope_type 'longrope' is not supported" in done.stderr, done.stderr
    assert "READY" not in done.stdout + done.stderr


def _broken(folder: Path, how: str) -> str:
    """Break a saved model folder one way; returns what the refusal must name."""
    if how == "unknown-model-type":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
        return "model_type 'falcon'"
    if how == "no-weights":
        for path in [*folder.glob("*.safetensors"), *folder.glob("*.index.json")]:
            path.unlink()
        return f"no weight files (*.safetensors or model.safetensors.index.json) in {folder}"
    shards = sorted(folder.glob("*.safetensors"))
    shards[-1].unlink()
    return f"names shard '{shards[-1].name}'"


@pytest.mark.parametrize("how", ["unknown-model-type", "no-weights", "missing-shard"])
def test_a_broken_model_folder_is_refused_before_anything_starts(how: str, tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100KB")
    named = _broken(folder, how)
    grpc_port, http_port = free_ports(2)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "up",
            "--model",
            str(folder),
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert named in done.stderr, done.stderr
    assert "READY" not in done.stdout + done.stderr
