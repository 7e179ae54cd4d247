"""Drafts from served text on workloads that repeat themselves across requests: an agent loop, questions over a fixed
set of documents (RAG), and repeated edits of the same code; each draft against `--draft none`, in one sitting.

Each workload is a set of sessions; a session's turns run in order, each turn's prompt the
conversation so far (an agent's tool results and the model's own answers quoted back). At
concurrency c, c sessions run at once. For each draft, each round starts `specserve up` with it
and runs each workload first once at c = 1 on a fresh stack ("first": nothing served yet), then
again at every concurrency ("again": the same sessions repeat, as an agent's turns do), and stops
it; the table gives output tokens per second (median over rounds) and its ratio to `--draft none`
measured in the same rounds.

    python -m bench.traffic_workloads --rounds 2 --concurrency 1 4
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.local_stack import running_up
from bench.machine_info import describe_machine

Messages = list[dict[str, str]]
Turn = Callable[..., Messages]  # the conversation so far -> the next prompt

TOOLS = """You can call one tool, get_weather(city: string, unit: "celsius" | "fahrenheit"). To call it, answer with
one line of JSON and nothing else: {"tool": "get_weather", "arguments": {"city": "...", "unit": "..."}}.
When a tool result comes back, answer the user in one sentence that quotes the temperature and the conditions."""
CITIES = ["Paris", "Madrid", "Oslo", "Lisbon", "Vienna", "Dublin", "Prague", "Athens"]

DOCUMENTS = """Document 1. The Harbour Line ferry leaves Pier 4 every 30 minutes from 6:00 to 22:00 on weekdays and
every hour at weekends. A single ticket costs 3.20 euros; a day pass costs 9 euros and is sold at the pier only.
Document 2. The city library opens at 9:00 and closes at 20:00 from Monday to Friday, and at 17:00 on Saturday. It
is closed on Sunday. Members may borrow ten books for three weeks; a renewal can be made online twice.
Document 3. Recycling is collected on Tuesday for paper and card, on Thursday for glass, and on Friday for plastic
and metal. Bins must be out by 7:00. Large items are collected on the first Monday of each month after booking."""
QUESTIONS = [
    "When does the ferry run at weekends?",
    "How much is a day pass for the ferry, and where is it sold?",
    "What time does the library close on Saturday?",
    "How many books may a member borrow, and for how long?",
    "Which day is glass collected?",
    "By what time must the bins be out?",
]

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""
EDITS = [
    "Rename the variable subtotal to net in this code and return the whole code:",
    "Add a docstring to each function in this code and return the whole code:",
    "Rename the parameter items to products in this code and return the whole code:",
    "Add type hints to this code and return the whole code:",
]


def agent_sessions() -> list[list[Turn]]:
    """Each session asks for one city's weather, gets a tool result quoted back, then asks about a second city."""
    sessions = []
    for index, city in enumerate(CITIES):
        other = CITIES[(index + 3) % len(CITIES)]
        degrees = 10 + 3 * index

        def first(history: Messages, city: str = city) -> Messages:
            return [
                {"role": "system", "content": TOOLS},
                {"role": "user", "content": f"What is the weather in {city} in celsius?"},
            ]

        def result(history: Messages, city: str = city, degrees: int = degrees) -> Messages:
            tool = json.dumps({"city": city, "unit": "celsius", "temperature": degrees, "conditions": "light rain"})
            return [*history, {"role": "user", "content": f"Tool result: {tool}"}]

        def second(history: Messages, other: str = other) -> Messages:
            return [*history, {"role": "user", "content": f"And what is the weather in {other} in celsius?"}]

        sessions.append([first, result, second])
    return sessions


def rag_sessions() -> list[list[Turn]]:
    """Each session asks two questions over the same documents."""
    sessions = []
    for index in range(len(QUESTIONS)):
        pair = (QUESTIONS[index], QUESTIONS[(index + 2) % len(QUESTIONS)])
        turns = []
        for number, question in enumerate(pair):

            def turn(history: Messages, question: str = question, first: bool = number == 0) -> Messages:
                ask = {"role": "user", "content": f"{DOCUMENTS}\n\nAnswer from the documents: {question}"}
                return [ask] if first else [*history, {"role": "user", "content": question}]

            turns.append(turn)
        sessions.append(turns)
    return sessions


def edit_sessions() -> list[list[Turn]]:
    """Each session asks for two edits of the same file, the second of the first's result."""
    sessions = []
    for index in range(len(EDITS)):
        pair = (EDITS[index], EDITS[(index + 1) % len(EDITS)])

        def first(history: Messages, ask: str = pair[0]) -> Messages:
            return [{"role": "user", "content": f"{ask}\n\n{CODE}"}]

        def second(history: Messages, ask: str = pair[1]) -> Messages:
            return [*history, {"role": "user", "content": f"{ask}\n\n(the code as you wrote it above)"}]

        sessions.append([first, second])
    return sessions


WORKLOADS = {"agent": agent_sessions, "rag": rag_sessions, "edits": edit_sessions}


def _chat(address: str, messages: Messages, max_tokens: int) -> tuple[str, int]:
    body = {"model": _model_name(address), "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"http://{address}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        answer: dict[str, Any] = json.load(reply)
    return answer["choices"][0]["message"]["content"], int(answer["usage"]["completion_tokens"])


def run_session(address: str, turns: list[Turn], max_tokens: int) -> int:
    """Output tokens of one session, its turns in order, each answer added to the conversation."""
    history: Messages = []
    tokens = 0
    for turn in turns:
        history = turn(history)
        text, count = _chat(address, history, max_tokens)
        history = [*history, {"role": "assistant", "content": text}]
        tokens += count
    return tokens


def run_workload(address: str, name: str, concurrency: int, max_tokens: int) -> float:
    """Output tokens per second of every session of the workload, `concurrency` at once."""
    sessions = WORKLOADS[name]()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda turns: run_session(address, turns, max_tokens), sessions))
    return tokens / (time.perf_counter() - started)


@functools.cache
def _model_name(address: str) -> str:
    """The name the stack serves its model under (a request naming another is refused)."""
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=30) as reply:
        return str(json.load(reply)["data"][0]["id"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--drafts",
        nargs="+",
        default=["none", "default:0", "default", "suffix"],
        help="each DRAFT[:SUFFIX_CACHE_TOKENS] (default:0: the default draft without the store)",
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {draft: {} for draft in args.drafts}
    machine: dict[str, Any] = {}
    for round_ in range(args.rounds):
        for draft in args.drafts:
            name, _, cache = draft.partition(":")
            flags = ["--draft", name, "--insecure-loopback", *(["--suffix-cache-tokens", cache] if cache else [])]
            with running_up(flags) as stack:
                machine = describe_machine(stack.dtype, stack.device)
                for workload in WORKLOADS:
                    runs = [("first", 1)] + [("again", concurrency) for concurrency in args.concurrency]
                    for label, concurrency in runs:
                        rate = run_workload(stack.http_address, workload, concurrency, args.max_tokens)
                        cell = f"{workload} {label} c={concurrency}"
                        results[draft].setdefault(cell, []).append(rate)
                        print(f"round {round_} {draft} {cell}: {rate:.1f} tok/s", flush=True)
    cells = list(results[args.drafts[0]])
    print(f"\n| workload | {' | '.join(args.drafts)} |\n|---|{'---|' * len(args.drafts)}")
    for cell in cells:
        base = statistics.median(results[args.drafts[0]][cell])
        row = [f"{base:.1f} tok/s"]
        for draft in args.drafts[1:]:
            ratios = [rate / none for rate, none in zip(results[draft][cell], results[args.drafts[0]][cell])]
            row.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {cell} | {' | '.join(row)} |")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"machine": machine, "results": results, "args": vars(args)}, out, indent=1)


if __name__ == "__main__":
    main()
