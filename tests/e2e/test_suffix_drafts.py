"""Drafting from served text (`--draft suffix`) through the whole stack: greedy output stays the target's whatever the
store holds, a repeated workload is accepted more the second time, and one tenant's text drafts for no other.

Requests go to the OpenAI HTTP API, each with a `user` (its tenant where no API key says).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from common.draft_spec import DraftKind, DraftSpec
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack

NUM_TOKENS = 32
PROMPTS = [
    "Write a haiku about the sea.",
    "List three colours of the rainbow.",
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Write a Python function that returns the square of a number.",
    "Name two planets of the solar system.",
    "Give a short greeting for a birthday card.",
    "What does a compiler do?",
]
SPECULATE = ("--num-speculative-tokens", "6", "--spec-disable-batch-threshold", "8")


def _config(model: Path, draft: DraftSpec | None, *draft_args: str) -> StackConfig:
    return StackConfig(
        model,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        draft=draft,
        draft_args=draft_args,
        scheduler_args=SPECULATE,
        speculation_policy="fixed",  # every step speculates: what is tested is what the store offers
    )


@pytest.fixture(scope="module")
def plain(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(_config(default_model_dir, None), tmp_path_factory.mktemp("plain")) as stack:
        yield stack


@pytest.fixture(scope="module")
def shared(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Every caller's text drafts for every other's (--suffix-scope global): the store is used as much as it can be."""
    config = _config(default_model_dir, DraftSpec(DraftKind.SUFFIX), "--suffix-scope", "global")
    with running_stack(config, tmp_path_factory.mktemp("shared")) as stack:
        yield stack


def _complete(stack: Stack, prompt: str, user: str) -> dict[str, Any]:
    body = {
        "model": stack.config.model.name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "user": user,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.addresses.http_port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer: dict[str, Any] = json.load(reply)
        return answer


def _all(stack: Stack, user: str) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrency 8
        return list(pool.map(lambda prompt: _complete(stack, prompt, user), PROMPTS))


def _texts(answers: list[dict[str, Any]]) -> list[str]:
    return [answer["choices"][0]["message"]["content"] for answer in answers]


def _accepted(answers: list[dict[str, Any]]) -> int:
    return sum(answer["usage"]["speculation"]["accepted_draft_tokens"] for answer in answers)


def test_greedy_output_is_the_targets_after_other_tenants_filled_the_store(plain: Stack, shared: Stack) -> None:
    expected = _texts(_all(plain, "someone"))
    for round_ in range(3):  # other tenants' requests fill the store, then each round drafts from the last
        answers = _all(shared, f"tenant-{round_}")
        assert _texts(answers) == expected, f"round {round_}: greedy output differs with the store's drafts"
    assert _accepted(answers) > 0, "the store's drafts were never accepted"


def test_a_repeated_workload_is_accepted_more_once_its_text_is_stored(default_model_dir: Path, tmp_path: Path) -> None:
    config = _config(default_model_dir, DraftSpec(DraftKind.SUFFIX))  # --suffix-scope tenant, the default
    with running_stack(config, tmp_path) as stack:
        first = _accepted(_all(stack, "alice"))
        again = _accepted(_all(stack, "alice"))
        other = _accepted(_all(stack, "bob"))  # the same prompts from another tenant: alice's text is not offered
        assert again > first and again > 2 * other, (first, again, other)
