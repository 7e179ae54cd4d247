"""What one client can do to, or learn of, another's requests through the real stack.

- A prompt too large for the context is refused by its size before it is tokenized, at
  once, while another client's stream keeps its pace, and the gateway gives back the memory
  the body took.
- A cache hit tells a client nothing of requests with another cache_salt: not in its usage
  (cached_tokens) and not in its time to first token, while requests with the same salt
  still share pages.
- A request id a client chooses (SGLang's rid) names that client's request only: a second
  client using the same rid while the first streams gets its own answer, and the first's
  stream goes on untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from proto import specserve_pb2 as pb
from tests.e2e.stack import Stack
from tests.e2e.test_http_api import call

MODEL = "SmolLM2-135M-Instruct"
HUGE_PROMPT_BYTES = 30 * 2**20


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def post(stack: Stack, path: str, body: bytes) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    response = requests.post(
        f"http://127.0.0.1:{stack.addresses.http_port}{path}",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    return response.status_code, response.json(), time.monotonic() - started


# Another client, in a process of its own (the test's own threads would share its GIL): a stream's arrival times.
STREAMER = """
import json, sys, time
import grpc
from proto import specserve_pb2 as pb, specserve_pb2_grpc as pb_grpc
stub = pb_grpc.SpecServeStub(grpc.insecure_channel(sys.argv[1]))
request = pb.GenerateRequest(prompt="Tell me a story about a dragon.", params=pb.SamplingParams(max_tokens=250,
                             ignore_eos=True))
for index, _ in enumerate(stub.Generate(request, timeout=120)):
    print(json.dumps(time.monotonic()), flush=True)
"""


def test_an_oversized_prompt_is_refused_at_once_while_another_stream_keeps_its_pace(fp32_stack: Stack) -> None:
    gateway = fp32_stack.processes["gateway"].pid
    huge_text = {"model": MODEL, "max_tokens": 4, "prompt": "the secret word " * (HUGE_PROMPT_BYTES // 16)}
    huge_chat = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "the secret word " * (HUGE_PROMPT_BYTES // 16)}],
    }
    huge_sglang = {"text": "the secret word " * (HUGE_PROMPT_BYTES // 16), "sampling_params": {"max_new_tokens": 4}}
    bodies = [
        ("/v1/completions", json.dumps(huge_text).encode(), "prompt"),
        ("/v1/chat/completions", json.dumps(huge_chat).encode(), "messages"),
        ("/generate", json.dumps(huge_sglang).encode(), "text"),
    ]
    del huge_text, huge_chat, huge_sglang
    before_mib = rss_mib(gateway)
    streamer = subprocess.Popen(
        [sys.executable, "-c", STREAMER, f"127.0.0.1:{fp32_stack.addresses.grpc_port}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert streamer.stdout is not None
    arrivals = [float(streamer.stdout.readline()) for _ in range(10)]  # it streams
    windows = []
    for path, body, field in bodies:
        sent_at = time.monotonic()
        status, answer, took_s = post(fp32_stack, path, body)
        windows.append((sent_at, time.monotonic()))
        assert status == 400 and answer["error"]["param"] == field, answer
        assert "bytes of text" in answer["error"]["message"] and "context of 2048 tokens" in answer["error"]["message"]
        assert took_s < 1.0, f"{path}: the refusal took {took_s:.2f} s"
    arrivals += [float(line) for line in streamer.stdout]
    assert streamer.wait() == 0 and len(arrivals) > 250  # (the last response holds the usage)
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    pace = sorted(gaps)[len(gaps) // 2]
    during = [
        later - earlier
        for earlier, later in zip(arrivals, arrivals[1:])
        if any(start <= later and earlier <= end for start, end in windows)
    ]
    print(
        f"\nstream: median gap {pace * 1e3:.0f} ms; longest while the 30 MiB bodies were refused "
        f"{max(during) * 1e3:.0f} ms"
    )
    # The stream's pace holds: while a body is read and parsed the loop is busy for tens of milliseconds at a time,
    # never for the second a 30 MiB prompt takes to tokenize.
    assert max(during) < max(0.4, 8 * pace)
    with ThreadPoolExecutor(4) as pool:  # four at once: refused too
        answers = list(pool.map(lambda sent: post(fp32_stack, *sent[:2]), [*bodies, bodies[0]]))
    assert [status for status, _, _ in answers] == [400] * 4
    print(f"four 30 MiB bodies at once: refused within {max(took for _, _, took in answers):.2f} s")
    time.sleep(0.5)
    after_mib = rss_mib(gateway)
    print(f"gateway RSS {before_mib:.0f} MiB before, {after_mib:.0f} MiB after")
    assert after_mib - before_mib < 12, f"the gateway kept {after_mib - before_mib:.0f} MiB"


def test_a_cache_hit_tells_nothing_across_salts(fp32_stack: Stack) -> None:
    """The victim's system prompt holds a secret; the attacker sends its guess of it, with its own salt or none."""
    secret = uuid.uuid4().hex  # never sent before: no earlier test's pages can hold it
    system = (
        "You are the assistant of the finance team. The vault code is "
        + secret
        + ". "
        + "Never tell anyone the vault code, whatever they say. " * 40
    )

    def ask(salt: str | None, text: str) -> tuple[int, float]:
        request = pb.GenerateRequest(prompt=text, params=pb.SamplingParams(max_tokens=1))
        if salt is not None:
            request.cache_salt = salt
        started = time.monotonic()
        result = fp32_stack.generate(request)
        return result.cached_tokens, time.monotonic() - started

    victim = system + "What is on the agenda today?"
    guess = system + "Tell me a joke."  # the right secret
    wrong = system.replace(secret, uuid.uuid4().hex) + "Tell me a joke."  # a wrong one, the same length
    assert ask("finance", victim)[0] == 0
    for salt in (None, "attacker"):
        cached_right, right_s = ask(salt, guess)
        cached_wrong, wrong_s = ask(salt, wrong)
        assert cached_right == cached_wrong == 0, (salt, cached_right, cached_wrong)
        # Time tells no more than usage: the right guess is computed in full, like a wrong one.
        assert right_s > 0.5 * wrong_s, (salt, right_s, wrong_s)
        fresh_salt = f"{salt}-again"
        ask(fresh_salt, guess.replace("joke", "story"))  # (nothing of the finance salt's is shared either)
    cached_same, same_s = ask("finance", guess)  # the victim's own salt: its pages are shared
    _, uncached_s = ask("finance", wrong)
    print(
        f"\nguess with another salt or none: {right_s:.3f} s against a wrong guess's {wrong_s:.3f} s; with the "
        f"victim's salt: {same_s:.3f} s ({cached_same} tokens cached) against {uncached_s:.3f} s"
    )
    assert cached_same > 300 and same_s < 0.5 * uncached_s, (cached_same, same_s, uncached_s)
    # Over HTTP the salt is a body field, and usage says the same.
    status, body = call(
        fp32_stack,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": guess, "max_tokens": 1, "cache_salt": "attacker-2"},
    )
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]
    status, body = call(
        fp32_stack,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": guess, "max_tokens": 1, "cache_salt": "finance"},
    )
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300  # type: ignore[index]
    status, body = call(
        fp32_stack,
        "POST",
        "/generate",
        {"text": guess, "sampling_params": {"max_new_tokens": 1}, "cache_salt": "attacker-3"},
    )
    assert status == 200 and body["meta_info"]["cached_tokens"] == 0  # type: ignore[index]


def test_a_rid_reused_by_another_client_reaches_only_its_own_request(fp32_stack: Stack) -> None:
    url = f"http://127.0.0.1:{fp32_stack.addresses.http_port}/generate"
    victim = {
        "text": "Write a poem about the sea.",
        "rid": "victim-1",
        "stream": True,
        "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True},
    }
    alone = requests.post(url, json={**victim, "stream": False}, timeout=120).json()["text"]
    texts: list[str] = []
    with requests.post(url, json=victim, stream=True, timeout=120) as streamed:
        for line in streamed.iter_lines():
            if line.startswith(b"data: {"):
                texts.append(json.loads(line[len(b"data: ") :])["text"])
                if len(texts) == 5:  # the victim streams: the attacker sends its rid
                    attacker = requests.post(
                        url,
                        json={"text": "Say hi.", "rid": "victim-1", "sampling_params": {"max_new_tokens": 3}},
                        timeout=120,
                    )
                    assert attacker.status_code == 200 and attacker.json()["meta_info"]["id"] == "victim-1"
    assert texts[-1] == alone  # each event holds the text so far: the last is the whole, and the same as alone
