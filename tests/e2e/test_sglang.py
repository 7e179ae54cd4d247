"""SGLang's native API on a real stack: a program in SGLang's frontend language runs through `RuntimeEndpoint`
unchanged (`gen` with and without a regex, `select`, `fork`), and /generate, /flush_cache and /get_model_info answer
as SGLang's server does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from common.text.tokenizer import Tokenizer
from proto import specserve_pb2 as pb
from tests.e2e.reference import ReferenceModel
from tests.e2e.stack import Stack

TOLERANCE = 2e-3


def url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.addresses.http_port}"


def sglang_normalized(reference: ReferenceModel, tokenizer: Tokenizer, prefix: str, choice: str) -> float:
    """What SGLang's select computes for a choice (token_length_normalized, with its token healing), from the
    model's own log-probabilities."""
    start = max(len(tokenizer.encode(prefix)) - 2, 0)
    ids = tokenizer.encode(prefix + choice)
    log_probs = reference.log_softmax(ids)
    entries = [
        (None if j == 0 else float(log_probs[j - 1, ids[j]]), tokenizer.token_text(ids[j]))
        for j in range(start, len(ids))
    ]
    values = [value for value, _ in entries if value]
    normalized = sum(values) / len(values)
    if prefix.endswith(entries[0][1]) and entries[0][0] is not None:
        normalized = (normalized * len(entries) - entries[0][0]) / (len(entries) - 1)
    return normalized


def test_a_frontend_program_with_gen_regex_select_and_fork_runs_against_the_stack(
    fp32_stack: Stack, default_model_dir: Path
) -> None:
    import sglang as sgl  # a test dependency (Makefile): its frontend only

    @sgl.function
    def program(s, question):  # type: ignore[no-untyped-def]
        s += "Question: " + question + "\n"
        s += "Answer: The capital of France is" + sgl.gen("answer", max_tokens=12, stop=".", temperature=0)
        s += "\nIs that right? Reply:" + sgl.select("verdict", choices=[" yes", " no"])
        forks = s.fork(2)
        for index, fork in enumerate(forks):
            fork += f"\nA {('year', 'colour')[index]}:" + sgl.gen(
                "item", max_tokens=8, temperature=0, regex=(r" (19|20)[0-9]{2}", r" (red|green|blue)")[index]
            )
        forks.join()
        s += "\nYear:" + forks[0]["item"] + "\nColour:" + forks[1]["item"] + "\nDone."

    backend = sgl.RuntimeEndpoint(url(fp32_stack))
    state = program.run(question="What is the capital of France?", backend=backend)
    tokenizer = Tokenizer.load(default_model_dir)
    prefix = "Question: What is the capital of France?\nAnswer: The capital of France is"
    own = fp32_stack.generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=tokenizer.encode(prefix)), params=pb.SamplingParams(max_tokens=12, stop=["."])
        )
    )
    assert state["answer"] == own.text and own.text.strip()  # greedy, as the server's own API gives it
    # select: what the model's own log-likelihoods say, as SGLang normalizes them.
    reference = ReferenceModel(default_model_dir, torch.float32)
    before = f"{prefix}{state['answer']}\nIs that right? Reply:"
    scores = [sglang_normalized(reference, tokenizer, before, choice) for choice in (" yes", " no")]
    assert state["verdict"] == (" yes", " no")[scores.index(max(scores))]
    said = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
    assert said == pytest.approx(scores, abs=TOLERANCE)
    text = state.text()
    assert re.search(r"\nYear: (19|20)[0-9]{2}\nColour: (red|green|blue)\nDone\.$", text), text


def test_generate_answers_as_sglangs_server(fp32_stack: Stack, default_model_dir: Path) -> None:
    tokenizer = Tokenizer.load(default_model_dir)
    ids = tokenizer.encode("The capital of France is")
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    answer = requests.post(url(fp32_stack) + "/generate", json=body, timeout=60).json()
    meta = answer["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert [entry[1] for entry in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == 4 and all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert "".join(entry[2] for entry in meta["output_token_logprobs"]) == answer["text"]
    own = fp32_stack.generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParams(max_tokens=4))
    )
    assert answer["text"] == own.text
    # A list of prompts: a list of answers; streaming: cumulative text, then [DONE].
    both = requests.post(
        url(fp32_stack) + "/generate",
        json={"text": ["One, two,", "Red, green,"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        timeout=60,
    ).json()
    assert isinstance(both, list) and len(both) == 2 and all(one["meta_info"]["completion_tokens"] == 3 for one in both)
    lines = requests.post(
        url(fp32_stack) + "/generate",
        json={"text": "One, two,", "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        timeout=60,
        stream=True,
    ).iter_lines()
    events = [line.decode() for line in lines if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["text"] == both[0]["text"]
    info = requests.get(url(fp32_stack) + "/get_model_info", timeout=10).json()
    assert info["model_path"] == "SmolLM2-135M-Instruct" and info["is_generation"] is True
    assert requests.get(url(fp32_stack) + "/get_server_info", timeout=10).json()["context_length"] > 0


def test_flush_cache_forgets_the_pages_no_request_holds(fp32_stack: Stack) -> None:
    long = "A long shared prefix about lighthouses and the sea. " * 6
    requests.post(
        url(fp32_stack) + "/generate", json={"text": long, "sampling_params": {"max_new_tokens": 1}}, timeout=60
    )
    assert sum(p.num_cached_kv_pages for p in fp32_stack.info().processes if p.role == "target") > 0
    answer = requests.post(url(fp32_stack) + "/flush_cache", timeout=30)
    assert answer.status_code == 200
    assert sum(p.num_cached_kv_pages for p in fp32_stack.info().processes if p.role == "target") == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "text"),
        ({"text": "x", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
        ({"text": "x", "sampling_params": {"wibble": 1}}, "sampling_params.wibble"),
        ({"text": "x", "sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias"),
        ({"text": "x", "sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
        ({"text": "x", "sampling_params": {"regex": "("}}, "sampling_params.regex"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),  # a body field this server does not honour
        ({"text": "x", "image_data": "data:image/png;base64,AA=="}, "image_data"),
    ],
)
def test_bad_generate_requests_are_400_naming_the_field(fp32_stack: Stack, body: dict[str, Any], param: str) -> None:
    answer = requests.post(url(fp32_stack) + "/generate", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
