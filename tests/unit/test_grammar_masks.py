"""Grammar masks on the target runner: a tiny random model with the embedded model's tokenizer follows its grammar,
the same with and without draft tokens (chains and trees, greedy and sampled), and a worker that never saw the
request rebuilds the grammar's state from the tokens the step carries."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker.runner import ModelRunner
from modeling.model.batch import PageError
from modeling.model.config import ModelConfig
from common.text.structured import StructuredSpec, compile_spec, grammar_tokenizer
from common.text.tokenizer import Tokenizer
from proto.messages import SamplingParams, SeqWork
from tests.unit.test_verify_and_propose import runner as tiny_runner

PROMPT = [504, 2114, 30, 1170]
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["red", "green"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammar_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama over the embedded model's vocabulary, with its tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("grammar_model")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def grammar_of(folder: Path, spec: StructuredSpec) -> str:
    tokenizer = Tokenizer.load(folder)
    return compile_spec(spec, grammar_tokenizer(tokenizer.backend_json(), 49152, tokenizer.eos_token_ids))


def step(
    r: ModelRunner,
    sequence: list[int],
    drafts: list[int],
    params: SamplingParams,
    grammar: str,
    parents: list[int] | None = None,
):  # type: ignore[no-untyped-def]
    start = len(sequence) - 1 if len(sequence) > len(PROMPT) else 0
    tokens = sequence[start:]
    (out,), _, _ = r.execute(
        [
            SeqWork(
                "g",
                list(range(8)),
                start,
                [*tokens, *drafts],
                True,
                params,
                num_draft_tokens=len(drafts),
                draft_parents=parents,
                history=sequence[:start],
                num_prompt_tokens=len(PROMPT),
                grammar=grammar,
                logprobs=1,
            )
        ]
    )
    return out


def generate(r: ModelRunner, grammar: str, params: SamplingParams, propose=None, parents=None, limit: int = 40):  # type: ignore[no-untyped-def]
    sequence, logprobs, forced_seen = list(PROMPT), [], 0
    drafts: list[int] = []
    while len(sequence) - len(PROMPT) < limit:
        out = step(r, sequence, drafts, params, grammar, parents if drafts and propose else None)
        sequence += out.token_ids
        logprobs += out.logprobs
        forced_seen += len(out.forced_token_ids)
        if out.grammar_complete:  # cut after end-of-sequence, as the scheduler does
            completion = sequence[len(PROMPT) :]
            end = completion.index(EOS) + 1
            return completion[:end], logprobs[:end], forced_seen
        drafts = propose(sequence, out.forced_token_ids) if propose else []
    raise AssertionError("the grammar never completed")


def runner(folder: Path) -> ModelRunner:
    r = tiny_runner(folder)
    assert r._model_config.vocab_size == 49152  # noqa: SLF001
    return r


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "sampled"]
)
def test_output_follows_a_schema_the_same_with_forced_chain_and_tree_drafts(
    grammar_model: Path, params: SamplingParams
) -> None:
    grammar = grammar_of(grammar_model, StructuredSpec("json_schema", json.dumps(SCHEMA)))
    tokenizer = Tokenizer.load(grammar_model)
    plain, plain_logprobs, forced = generate(runner(grammar_model), grammar, params)
    value = json.loads(tokenizer.decode(plain))
    assert set(value) == {"id", "tag"} and value["tag"] in ("red", "green") and 0 <= value["id"] <= 99
    assert forced > 0  # keys and separators are forced
    for propose, parents in (
        (lambda seq, f: f[:4], None),  # what the grammar forces: always right
        (lambda seq, f: [*f[:2], 13, 220], None),  # then two the grammar refuses
        (lambda seq, f: [f[0] if f else 220, 1, 13, 220], [-1, 0, -1, 2]),
    ):  # a tree
        tokens, logprobs, _ = generate(runner(grammar_model), grammar, params, propose, parents)
        assert tokens == plain and logprobs == plain_logprobs


def test_a_regex_and_a_fresh_worker_rebuilding_the_state_mid_way(grammar_model: Path) -> None:
    grammar = grammar_of(grammar_model, StructuredSpec("regex", "(cat|dog)-[0-9]{3}"))
    tokens, _, _ = generate(runner(grammar_model), grammar, SamplingParams())
    text = Tokenizer.load(grammar_model).decode(tokens)
    assert re.fullmatch("(cat|dog)-[0-9]{3}", text), text
    first = runner(grammar_model)
    out = step(first, list(PROMPT), [], SamplingParams(), grammar)
    fresh = runner(grammar_model)  # never saw the request: rebuilds from the completion's first token
    sequence = list(PROMPT) + out.token_ids
    step(fresh, sequence[:-1], [], SamplingParams(), grammar)  # writes the prompt's KV on this worker
    again = step(fresh, sequence, [], SamplingParams(), grammar)
    assert sequence[len(PROMPT) :] + again.token_ids == tokens[: len(out.token_ids) + len(again.token_ids)]


def test_a_completion_that_does_not_follow_its_grammar_is_refused_as_the_requests_own(grammar_model: Path) -> None:
    grammar = grammar_of(grammar_model, StructuredSpec("regex", "[0-9]+"))
    r = runner(grammar_model)
    letters = Tokenizer.load(grammar_model).encode_raw("abc")
    with pytest.raises(PageError) as caught:
        step(r, list(PROMPT) + letters, [], SamplingParams(), grammar)
    assert caught.value.request_id == "g" and "does not follow its grammar" in str(caught.value)
    with pytest.raises(PageError) as caught:
        step(r, list(PROMPT), [], SamplingParams(), "not a grammar")
    assert caught.value.request_id == "g"


def test_the_model_config_of_the_grammar_model(grammar_model: Path) -> None:
    assert ModelConfig.from_folder(grammar_model).vocab_size == 49152
