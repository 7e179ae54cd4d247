"""Greedy answers of a checkout's `specserve up` to the held-out prompts, to show a change left every output as it was.

For each draft asked for, it starts `specserve up` from CHECKOUT (this one, or an earlier
revision's worktree: the stack's processes then run that revision's code), sends every prompt
of bench/spec_prompts.py (editing, chat, code) to the OpenAI HTTP API greedily one at a time,
and writes the answers as JSON. `--compare` then lists every answer that differs.

    git worktree add /tmp/before 3e8a605
    python -m bench.greedy_outputs --checkout /tmp/before --out before.json
    python -m bench.greedy_outputs --out after.json
    python -m bench.greedy_outputs --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.spec_prompts import WORKLOADS
from specserve.stack import free_ports

REPO = Path(__file__).resolve().parents[1]


def _post(port: int, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer: dict[str, object] = json.load(reply)
        return answer


def answers(checkout: Path, draft: str, max_tokens: int, log: Path) -> dict[str, str]:
    """Each prompt's greedy answer from `checkout`'s `specserve up --draft DRAFT`, by workload and index."""
    grpc_port, http_port = free_ports(2)
    command = [
        sys.executable,
        "-m",
        "specserve.cli",
        "up",
        "--draft",
        draft,
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--insecure-loopback",
    ]
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=checkout, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 900
            while "specserve ready" not in log.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"specserve up did not serve:\n{log.read_text()[-3000:]}")
                time.sleep(1.0)
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as reply:
                model = json.load(reply)["data"][0]["id"]
            found: dict[str, str] = {}
            for workload, prompts in WORKLOADS.items():
                for index, prompt in enumerate(prompts):
                    reply = _post(
                        http_port,
                        {
                            "model": model,
                            "messages": [{"role": "user", "content": prompt}],
                            "temperature": 0,
                            "max_tokens": max_tokens,
                        },
                    )
                    found[f"{workload}/{index}"] = reply["choices"][0]["message"]["content"]  # type: ignore[index]
            return found
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", type=Path, default=REPO, help="the source tree whose stack answers")
    parser.add_argument("--draft", nargs="+", default=["none", "default"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, help="where the answers go (JSON)")
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="list the answers that differ between two such files; exit 1 if any does",
    )
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(path.read_text()) for path in args.compare)
        differ = [key for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
        print(
            f"{len(before)} answers before, {len(after)} after, {len(differ)} differ"
            + "".join(f"\n  {key}" for key in differ)
        )
        return 1 if differ else 0
    if args.out is None:
        parser.error("--out is needed (or --compare)")
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="greedy-") as folder:
        for draft in args.draft:
            for key, text in answers(args.checkout.resolve(), draft, args.max_tokens, Path(folder) / "up.log").items():
                results[f"{draft}/{key}"] = text
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{len(results)} answers from {args.checkout} written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
