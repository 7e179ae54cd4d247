"""The shipped EAGLE head is right as often through the bfloat16 stack as it is offline.

Offline, in this process, the head reads the target's own answers teacher-forced, with the
target's features for them, and its first draft token is the target's next token some share
p of the time (bench/draft_head.py `accuracy` measures the same). Through the stack the
target's features travel from the worker to the scheduler to the draft service, the head
keeps its own paged cache from step to step, and the first draft token of a verify step is
accepted exactly when it is the target's next token. So the share of verify steps that
accept their first draft token estimates the same p, over the positions where verify steps
start. Features misaligned by a position, stale pairs in the head's cache or rows of another
sequence would show as a lower share.
"""

from __future__ import annotations

import math
import re
import urllib.request
from pathlib import Path

import torch

from bench.spec_prompts import CHAT, CODE
from common.draft_spec import DraftSpec
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.eagle import EagleEngine
from modeling.model.engine import ModelEngine
from modeling.model.kv_cache import pages_for_slots, slot_pages
from modeling.model.store import default_draft_dir
from common.text.tokenizer import ChatMessage, Tokenizer
from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import running_stack

NUM_TOKENS = 64
MAX_LEN = 512


def first_position_counts(metrics_url: str) -> tuple[int, int]:
    """(verify steps that proposed a first draft token, those that accepted it) from the gateway's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def count(name: str) -> int:
        found = re.search(rf'^{name}_total\{{position="0"\}} ([0-9.e+]+)$', text, re.MULTILINE)
        assert found is not None, f"{name} missing from /metrics"
        return int(float(found.group(1)))

    return count("specserve_spec_decode_num_drafts_per_pos"), count("specserve_spec_decode_num_accepted_tokens_per_pos")


def offline_accuracy(target: Path, head_folder: Path, sequences: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(answer positions, those whose next token the head's first draft names), each sequence (prompt, answer) read
    teacher-forced: row j of the head reads (f_j, x_{j+1}) and proposes x_{j+2}."""
    engine = ModelEngine(
        target,
        ModelConfig.from_folder(target),
        device="cpu",
        dtype="bfloat16",
        num_pages=pages_for_slots(1, MAX_LEN),
        max_len=MAX_LEN,
    )
    engine.load()
    engine.allocate()
    head = EagleEngine(
        head_folder, target, device="cpu", dtype="bfloat16", num_pages=pages_for_slots(1, MAX_LEN), max_len=MAX_LEN
    )
    head.load()
    head.allocate()
    assert head.draft_vocab is not None
    total = right = 0
    for prompt, answer in sequences:
        tokens = prompt + answer
        n = len(tokens)
        _, features = engine.forward_with_features([SeqSpan(slot_pages(0, MAX_LEN), 0, tokens, 1)])
        logits, _ = head.forward([SeqSpan(slot_pages(0, MAX_LEN), 0, tokens[1 : n - 1], n - 2)], features[: n - 2])
        proposed = head.draft_vocab[logits.argmax(-1)]
        # The stack drafts from the answer's second token on (the prefill makes the first).
        first = len(prompt) - 1
        right += int((proposed[first:] == torch.tensor(tokens[2:])[first:]).sum())
        total += n - 2 - first
    return total, right


def test_the_head_is_right_as_often_through_the_bfloat16_stack_as_offline(
    default_model_dir: Path, tmp_path: Path
) -> None:
    head_folder = default_draft_dir()
    options = StackConfig(
        default_model_dir,
        dtype="bfloat16",
        num_workers=1,
        max_num_seqs=4,
        draft=DraftSpec.parse(f"eagle:{head_folder}", flag="--draft"),
        num_speculative_tokens=6,
        speculation_policy="fixed",
    )
    tokenizer = Tokenizer.load(default_model_dir)
    prompts = [tokenizer.encode_chat([ChatMessage("user", text)]) for text in CHAT + CODE]
    params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    (tmp_path / "logs").mkdir()
    with running_stack(options, tmp_path / "logs") as stack:
        answers = [
            stack.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=params)).token_ids
            for ids in prompts
        ]
        stack.wait_idle()
        proposed, accepted = first_position_counts(f"http://127.0.0.1:{stack.addresses.http_port}/metrics")
    assert all(len(answer) == NUM_TOKENS for answer in answers)
    positions, right = offline_accuracy(default_model_dir, head_folder, list(zip(prompts, answers)))
    offline = right / positions
    through = accepted / proposed
    # Three standard errors of the two shares, and 0.03 for the positions they are taken over.
    spread = 3 * math.sqrt(offline * (1 - offline) / positions + through * (1 - through) / proposed) + 0.03
    print(
        f"the head's first draft token: right {right} of {positions} offline ({offline:.3f}); accepted {accepted} of "
        f"{proposed} verify steps through the stack ({through:.3f})"
    )
    assert proposed >= 300, f"only {proposed} verify steps"
    assert abs(through - offline) <= spread, (
        f"through the stack the head's first draft token was accepted in {accepted} of {proposed} verify steps "
        f"({through:.3f}), offline it is right at {right} of {positions} positions ({offline:.3f})"
    )
