"""Speculative decoding through the whole stack: greedy output is the output without speculation, whatever proposes,
and so are its log-probabilities.

One float32 target worker and a draft service whose proposer changes between runs (the
service is stopped and a new one started, so speculation also stops and resumes):
n-gram lookup, a draft model folder (the target's first 4 layers: a poor draft), random
tokens, and a replay of the reference output (a perfect draft). Eight prompts are sent
with staggered arrivals, so the step size crosses the speculation threshold (4) on the
way up and on the way down, and steps mix verify and plain-decode sequences.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from common.draft_spec import DraftSpec
from common.text.tokenizer import ChatMessage, Tokenizer
from modeling.model.store import default_draft_dir
from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import GenerateResult, Stack, running_stack

NUM_TOKENS = 40
STAGGER_S = 0.15
PROMPTS = [
    ("chat", "Rewrite this sentence with correct spelling: 'The quick brwn fox jumpd over the lazzy dog.'"),
    ("raw", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"),
    ("chat", "What is the capital of France?"),
    ("raw", "1, 2, 3, 4, 5, 6, 7, 8,"),
    ("chat", "List three colours of the rainbow."),
    ("raw", "The quick brown fox jumps over the lazy dog. The quick brown fox"),
    ("chat", "Write a haiku about the sea."),
    ("raw", "Once upon a time, in a small village by the mountains,"),
]


def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode_chat([ChatMessage("user", text)]) if kind == "chat" else tokenizer.encode(text)
        for kind, text in PROMPTS
    ]


def request(ids: list[int], **params: object) -> pb.GenerateRequest:
    defaults: dict[str, object] = {"max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True}
    defaults.update(params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParams(**defaults))  # type: ignore[arg-type]


def run_staggered(stack: Stack, requests: list[pb.GenerateRequest]) -> list[GenerateResult]:
    def run(index: int) -> GenerateResult:
        time.sleep(index * STAGGER_S)
        return stack.generate(requests[index])

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, range(len(requests))))


@pytest.fixture(scope="module")
def truncated_draft(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's embedding and first 4 of its 30 layers, untrained: a draft that is mostly wrong."""
    folder = tmp_path_factory.mktemp("draft_4_layers")
    config = json.loads((default_model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(default_model_dir / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < 4
    }
    save_file(kept, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((default_model_dir / name).read_bytes())
    return folder


@pytest.fixture(scope="module")
def spec_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        scheduler_args=("--num-speculative-tokens", "4", "--spec-disable-batch-threshold", "4"),
        speculation_policy="fixed",
    )
    with running_stack(options, tmp_path_factory.mktemp("spec_stack")) as stack:
        yield stack


def draft_process(stack: Stack) -> pb.Process | None:
    return next((p for p in stack.info().processes if p.role == "draft"), None)


def switch_draft(stack: Stack, proposer: str | None) -> None:
    """Stop the running draft service (if any) and start one with `proposer` (if any); wait until it is READY."""
    old = stack.processes.pop("draft", None)
    if old is not None:
        old.terminate()
        assert old.wait(30) == 0, "the draft service did not drain cleanly"
    if proposer is None:
        return
    before = draft_process(stack)
    stack.start_draft(DraftSpec.parse(proposer, flag="--proposer"))
    deadline = time.monotonic() + 120
    while True:
        now = draft_process(stack)
        if now is not None and now.state == "READY" and (before is None or now.incarnation != before.incarnation):
            return
        assert time.monotonic() < deadline and stack.processes["draft"].poll() is None, stack.logs()
        time.sleep(0.1)


def test_greedy_is_lossless_with_every_proposer(
    spec_stack: Stack, default_model_dir: Path, truncated_draft: Path, tmp_path: Path
) -> None:
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    requests = [request(p, logprobs=2) for p in ids]
    switch_draft(spec_stack, None)
    plain = run_staggered(spec_stack, requests)
    baseline = [r.token_ids for r in plain]
    assert all(len(tokens) == NUM_TOKENS for tokens in baseline)
    assert all(r.logprobs is not None and len(r.logprobs) == NUM_TOKENS for r in plain)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps([p + out for p, out in zip(ids, baseline)]))

    for proposer in ("ngram", f"model:{truncated_draft}", "random:49152", f"replay:{replay}"):
        switch_draft(spec_stack, proposer)
        before = spec_stack.info().speculation
        results = run_staggered(spec_stack, requests)
        for index, (result, expected) in enumerate(zip(results, baseline)):
            assert result.token_ids == expected, f"{proposer}: prompt {index} differs from greedy without speculation"
            # Bit for bit: a verified token's log-probability is its target's at that position.
            assert result.logprobs == plain[index].logprobs, f"{proposer}: prompt {index}'s log-probabilities differ"
        info = spec_stack.wait_idle()  # the target's and the draft's KV are empty again
        assert sorted(p.role for p in info.processes if p.state == "READY") == ["draft", "target"]
        after = info.speculation
        proposed = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        assert proposed > 0, f"{proposer}: nothing was proposed"
        if proposer.startswith("replay"):
            assert accepted / proposed > 0.9, "the reference output should nearly always be accepted"
        else:  # (with the perfect draft requests finish too fast to pile up)
            assert (
                after.num_plain_decode_steps > before.num_plain_decode_steps
            )  # steps above the threshold decoded plainly
        if proposer.startswith("random"):
            assert accepted / proposed < 0.05, "random tokens should nearly always be rejected"


def test_greedy_is_lossless_in_bfloat16_and_with_the_shipped_drafts(default_model_dir: Path, tmp_path: Path) -> None:
    """bf16 rounds differently when a kernel changes;
    every row of a step is computed the same way whatever else is in it,
    so a verify step's rows are exactly the plain decode steps they replace. The shipped draft (drafts/, made by
    `specserve distill`): its phrases (what `--draft default` runs) and its EAGLE head, which reads the target's
    features through the scheduler, must agree far more often than chance, and change nothing."""
    options = StackConfig(
        default_model_dir,
        dtype="bfloat16",
        num_workers=1,
        max_num_seqs=8,
        scheduler_args=("--num-speculative-tokens", "6", "--spec-disable-batch-threshold", "4"),
        speculation_policy="fixed",
    )
    (tmp_path / "logs").mkdir()
    with running_stack(options, tmp_path / "logs") as stack:
        ids = prompt_ids(Tokenizer.load(default_model_dir))
        requests = [request(p) for p in ids]
        switch_draft(stack, None)
        baseline = [r.token_ids for r in run_staggered(stack, requests)]
        sampled = [request(p, temperature=0.8, top_p=0.95, seed=77 + i) for i, p in enumerate(ids[:2])]
        sampled_baseline = [stack.generate(r).token_ids for r in sampled]
        replay = tmp_path / "replay.json"
        replay.write_text(json.dumps([p + out for p, out in zip(ids, baseline)]))
        shipped = default_draft_dir()
        for proposer in (
            "ngram",
            f"replay:{replay}",
            f"phrases:{shipped}",
            f"eagle:{shipped}",
            f"eagle+phrases:{shipped}",
        ):
            switch_draft(stack, proposer)
            before = stack.info().speculation
            results = run_staggered(stack, requests)
            for index, (result, expected) in enumerate(zip(results, baseline)):
                assert result.token_ids == expected, (
                    f"{proposer}: prompt {index} differs from greedy without speculation"
                )
            if not proposer.startswith("eagle"):  # point-mass drafts (the phrases' as token trees): the target's own
                for index, (one, expected) in enumerate(zip(sampled, sampled_baseline)):  # draws, plain sampling's
                    assert stack.generate(one).token_ids == expected, f"{proposer}: sampled prompt {index} differs"
            after = stack.wait_idle().speculation
            proposed = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
            assert proposed > 0, proposer
            if proposer.startswith("eagle"):
                # Lossless, which is what this test holds; how often the head is right through the stack, against
                # offline, is held by test_draft_head_acceptance.py over enough verify steps to tell.
                continue
            assert accepted > 0, proposer
            if proposer.startswith("phrases"):  # measured 0.1-0.3 at k = 6; guesses would accept ~1/8192
                assert accepted / proposed > 0.05, f"{proposer} accepted only {accepted} of {proposed} draft tokens"


@pytest.mark.parametrize("proposer", ["ngram", "model"])
def test_seeded_sampling_with_speculation_is_reproducible(
    spec_stack: Stack, default_model_dir: Path, truncated_draft: Path, proposer: str
) -> None:
    switch_draft(spec_stack, "ngram" if proposer == "ngram" else f"model:{truncated_draft}")
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    sampled = request(ids[1], temperature=0.8, top_p=0.95, seed=1234, max_tokens=32, logprobs=1)
    first, second = spec_stack.generate(sampled), spec_stack.generate(sampled)
    assert first.token_ids == second.token_ids and first.logprobs == second.logprobs
    assert len(first.token_ids) == 32
    if proposer == "ngram":  # point-mass drafts are verified by the target's own draws: plain sampling's very tokens
        switch_draft(spec_stack, None)
        plain = spec_stack.generate(sampled)
        assert plain.token_ids == first.token_ids
        assert plain.logprobs == first.logprobs  # the target's, after temperature, with or without speculation


def test_penalized_biased_and_structured_output_is_the_same_with_and_without_speculation(
    spec_stack: Stack, default_model_dir: Path, truncated_draft: Path
) -> None:
    """Every verify row is penalized and masked by the grammar after its own branch, as the decode step it stands for
    would be."""
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    penalties = {
        "presence_penalty": 0.4,
        "frequency_penalty": 0.6,
        "repetition_penalty": 1.2,
        "logit_bias": {13: 2.0, 28: -5.0},
        "min_tokens": 8,
        "logprobs": 1,
    }
    requests = [request(p, **penalties) for p in ids[:4]]
    requests += [request(p, temperature=0.8, top_p=0.95, seed=21 + i, **penalties) for i, p in enumerate(ids[4:6])]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "colours": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
        },
        "required": ["name", "colours"],
    }
    structured = pb.StructuredOutput(json_schema=json.dumps(schema))
    requests.insert(4, request(ids[2], structured_output=structured, logprobs=1))  # greedy, in a grammar
    switch_draft(spec_stack, None)
    plain = run_staggered(spec_stack, requests)
    unpenalized = [spec_stack.generate(request(p)).token_ids for p in ids[:4]]
    assert [r.token_ids for r in plain[:4]] != unpenalized  # the penalties change what the model says
    for proposer in ("ngram", f"model:{truncated_draft}"):
        switch_draft(spec_stack, proposer)
        before = spec_stack.info().speculation
        results = run_staggered(spec_stack, requests)
        assert spec_stack.info().speculation.num_verify_steps > before.num_verify_steps, proposer
        for index, (result, expected) in enumerate(zip(results, plain)):
            if index >= 5 and proposer.startswith("model"):  # a sampled draft's q changes which tokens are drawn
                assert len(result.token_ids) == NUM_TOKENS
                continue
            assert result.token_ids == expected.token_ids, f"{proposer}: request {index} differs"
            assert result.logprobs == expected.logprobs, f"{proposer}: request {index}'s log-probabilities differ"


def test_usage_reports_the_requests_speculation(spec_stack: Stack, default_model_dir: Path) -> None:
    switch_draft(spec_stack, "ngram")
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    final = list(spec_stack.stub.Generate(request(ids[3], max_tokens=24), timeout=60))[-1]
    usage = final.usage
    assert usage.completion_tokens == 24
    assert 0 < usage.verify_steps and 0 <= usage.accepted_draft_tokens <= usage.draft_tokens
    # Every verify step yields its accepted drafts plus one token, as does every other step.
    assert usage.accepted_draft_tokens + usage.verify_steps <= usage.completion_tokens
    spec = spec_stack.info().speculation  # what a proposal costs: the draft's time, within the wait for its answer
    assert 0 < spec.propose_ms <= spec.propose_wait_ms, spec


def test_a_draft_of_another_vocabulary_is_refused_with_its_reason(
    spec_stack: Stack, tmp_path: Path, truncated_draft: Path
) -> None:
    other = tmp_path / "other_vocab"
    other.mkdir()
    for path in truncated_draft.iterdir():
        (other / path.name).symlink_to(path)
    (other / "tokenizer.json").unlink()
    tokenizer = json.loads((truncated_draft / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["specserve-extra"] = tokenizer["model"]["vocab"].pop("<|im_end|>", 0)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    switch_draft(spec_stack, None)
    spec_stack.start_draft(DraftSpec.parse(f"model:{other}", flag="--proposer"))
    deadline = time.monotonic() + 60
    while spec_stack.processes["draft"].poll() is None:
        assert time.monotonic() < deadline, "the refused draft service did not stop"
        time.sleep(0.1)
    refused = [p for p in spec_stack.info().processes if p.role == "draft"][-1]
    assert refused.state in ("FAILED", "STOPPED") and "vocabulary" in refused.failure
    assert "vocabulary" in spec_stack.logs()
    del spec_stack.processes["draft"]
    assert spec_stack.generate(request([1, 2, 3], max_tokens=4)).completion_tokens == 4  # serving goes on without it
