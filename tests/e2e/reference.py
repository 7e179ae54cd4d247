"""Hugging Face transformers on the same weights: greedy continuations with each step's top-2 logit margin, and
log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit before each generated token


class ReferenceModel:
    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        import transformers

        self._model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
        self._model.eval()

    def greedy(self, prompt_ids: list[int], num_tokens: int) -> Reference:
        """`generate()` with its own KV cache; end-of-sequence does not stop it (like ignore_eos)."""
        with torch.inference_mode():
            out = self._model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
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
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        margins = []
        for logits in out.logits:  # one [1, V] per generated token
            top2 = torch.topk(logits[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        return Reference(tokens, margins)

    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        """`[len(token_ids), V]`: the log-probabilities of the next token after each of token_ids, in float32."""
        with torch.inference_mode():
            logits = self._model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
