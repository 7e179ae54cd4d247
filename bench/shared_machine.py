"""Serving on a machine that is not ours alone: each server's speed beside busy neighbours, as a share of its own alone.

Each server is started in turn and meets the same neighbours in the same run: none, then
busy processes (`python3 -c 'while True: pass'`) started beside it (`--neighbours`: by
default one and two of them, at normal priority and at nice 19), then none again. At each, a light client (threads over
plain HTTP, one request at a time per thread: it takes little of the machine, and the
same for every server) sends real chat prompts (bench/spec_prompts.py) at each
concurrency, `--output-len` tokens each with the end of sequence ignored, greedy,
streamed. Output tok/s is the tokens received (the streamed text tokenized again with the
model's tokenizer, the same count for every server) over the wall time; a cell stops at
`--cell-timeout-s`, counting what had come by then.

Servers: `specserve` (`--draft none`), `specserve-draft` (the default draft), `vllm`
(`--vllm`, its CPU build: ../shared/bench-clients.md) and `llamacpp` (`--llama-server`,
llama.cpp's own server, on the embedded model's GGUF file, with `--llama-slots` parallel
slots). The neighbours are started from this process, in its session: with the kernel's
autogroups, a process of another session (another terminal) competes as a group of its
own whatever its nice value, as a process in another container does.

    python -m bench.shared_machine --servers specserve specserve-draft vllm llamacpp \\
        --vllm /tmp/vllmenv/bin/vllm --llama-server /tmp/llama-server-bin/llama-server --concurrency 1 16
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_stack import running_up
from bench.prefix_bench import served, vllm_env
from bench.spec_prompts import WORKLOADS
from specserve.local_stack import StackError
from specserve.stack import free_port, free_ports

SERVERS = ("specserve", "specserve-draft", "vllm", "llamacpp")
# Neighbours: (busy processes, their nice value), measured between a cell alone before and one after.
NEIGHBOURS = ((1, 0), (1, 19), (2, 0), (2, 19))
SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded model, as every server is told to call it


@dataclass(frozen=True)
class Cell:
    server: str
    concurrency: int
    busy: int  # busy processes beside the server
    nice: int  # their nice value
    output_tok_s: float
    completed: int  # requests that ended within the cell's time
    sent: int

    @property
    def neighbour(self) -> str:
        return "alone" if self.busy == 0 else f"{self.busy} busy, nice {self.nice}"


def prompts() -> list[str]:
    return [text for workload in WORKLOADS.values() for text in workload]


class Client:
    """Chat requests over HTTP to one server, `concurrency` at a time, each streamed to its end or the deadline."""

    def __init__(self, port: int, output_len: int, count_tokens: Callable[[str], int]) -> None:
        self._port = port
        self._output_len = output_len
        self._count_tokens = count_tokens

    def _one(self, prompt: str, deadline: float) -> tuple[str, bool]:
        """The text the server streamed for `prompt`, and whether it ended before `deadline`."""
        body = json.dumps(
            {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self._output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        )
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=max(1.0, deadline - time.monotonic()))
        pieces: list[str] = []
        try:
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise StackError(f"HTTP {response.status}: {response.read()[:300]!r}")
            while time.monotonic() < deadline:
                line = response.readline()
                if not line:
                    return "".join(pieces), True
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return "".join(pieces), True
                for choice in json.loads(data).get("choices", []):
                    pieces.append((choice.get("delta") or {}).get("content") or "")
            return "".join(pieces), False
        except TimeoutError:
            return "".join(pieces), False
        finally:
            connection.close()

    def run(self, texts: Sequence[str], concurrency: int, timeout_s: float) -> tuple[float, int]:
        """Output tok/s over the wall time of all `texts` (or up to the deadline), and how many ended in time."""
        lock = threading.Lock()
        queue = list(texts)
        tokens, completed = [0], [0]
        errors: list[BaseException] = []
        started = time.monotonic()
        deadline = started + timeout_s

        def worker() -> None:
            while time.monotonic() < deadline:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop(0)
                try:
                    text, ended = self._one(prompt, deadline)
                except (OSError, StackError, ValueError) as error:
                    errors.append(error)
                    return
                with lock:
                    tokens[0] += self._count_tokens(text)
                    completed[0] += ended

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 30)
        if errors:
            raise StackError(f"a request failed: {errors[0]}")
        return tokens[0] / (time.monotonic() - started), completed[0]


@contextmanager
def neighbours(busy: int, nice: int) -> Iterator[None]:
    """`busy` processes spinning at `nice`, from here to the end of the block."""
    processes = [
        subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"]) for _ in range(busy)
    ]
    try:
        time.sleep(0.5 if busy else 0)
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextmanager
def specserve_server(folder: Path, dtype: str, draft: str, extra: Sequence[str]) -> Iterator[int]:
    grpc_port, http_port = free_ports(2)
    flags = [
        "--model",
        str(folder),
        "--dtype",
        dtype,
        "--draft",
        draft,
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        *extra,
    ]
    print(f"starting: specserve up {shlex.join(flags)}", file=sys.stderr, flush=True)
    with running_up(flags) as stack:
        print(stack.ready_line, file=sys.stderr, flush=True)
        yield http_port


@contextmanager
def vllm_server(vllm: str, folder: Path, dtype: str, log_dir: Path) -> Iterator[int]:
    port = free_port()
    command = [
        vllm,
        "serve",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--served-model-name",
        SERVED_NAME,
    ]
    with served(command, port, log_dir / "vllm.log", vllm_env()):
        yield port


@contextmanager
def llamacpp_server(binary: str, gguf: Path, threads: int, slots: int, log_dir: Path) -> Iterator[int]:
    port = free_port()
    command = [
        binary,
        "--model",
        str(gguf),
        "--threads",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(2048 * slots),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        SERVED_NAME,
    ]
    with served(command, port, log_dir / "llamacpp.log", dict(os.environ)):
        yield port


def server_context(server: str, args: argparse.Namespace, work_dir: Path) -> AbstractContextManager[int]:
    if server == "specserve":
        return specserve_server(args.folder, args.dtype, "none", shlex.split(args.specserve_args))
    if server == "specserve-draft":
        return specserve_server(args.folder, args.dtype, "default", shlex.split(args.specserve_args))
    if server == "vllm":
        return vllm_server(args.vllm, args.folder, args.dtype, work_dir)
    return llamacpp_server(args.llama_server, args.gguf, os.cpu_count() or 1, args.llama_slots, work_dir)


def measure_server(
    server: str, args: argparse.Namespace, work_dir: Path, count_tokens: Callable[[str], int]
) -> list[Cell]:
    cells: list[Cell] = []
    texts = prompts()
    with server_context(server, args, work_dir) as port:
        client = Client(port, args.output_len, count_tokens)
        client.run(texts[:2], 1, args.cell_timeout_s)  # warm-up, unmeasured
        for busy, nice in [(0, 0), *args.neighbours, (0, 0)]:
            for concurrency in args.concurrency:
                sent = [texts[i % len(texts)] for i in range(max(4, 2 * concurrency))]
                with neighbours(busy, nice):
                    tok_s, completed = client.run(sent, concurrency, args.cell_timeout_s)
                cell = Cell(server, concurrency, busy, nice, tok_s, completed, len(sent))
                print(
                    f"{server} c={concurrency} {cell.neighbour}: {tok_s:.1f} tok/s, {completed}/{len(sent)} ended",
                    file=sys.stderr,
                    flush=True,
                )
                cells.append(cell)
    return cells


def format_table(cells: Sequence[Cell]) -> str:
    """One row per server and concurrency: tok/s alone (before, after), then each neighbour's as a share of alone."""
    crowded = list(dict.fromkeys((cell.busy, cell.nice) for cell in cells if cell.busy))
    header = (
        "| server | c | alone tok/s (before, after) | "
        + " | ".join(f"{busy} busy, nice {nice}" for busy, nice in crowded)
        + " |"
    )
    rows = [header, "|---|---:|---:|" + "---:|" * len(crowded)]
    for server in dict.fromkeys(cell.server for cell in cells):
        for concurrency in dict.fromkeys(cell.concurrency for cell in cells if cell.server == server):
            mine = [cell for cell in cells if cell.server == server and cell.concurrency == concurrency]
            alone = [cell.output_tok_s for cell in mine if cell.busy == 0]
            base = max(sum(alone) / len(alone), 1e-9)
            shares = []
            for busy, nice in crowded:
                cell = next(c for c in mine if (c.busy, c.nice) == (busy, nice))
                late = "" if cell.completed == cell.sent else f", {cell.completed}/{cell.sent} ended"
                shares.append(f"{cell.output_tok_s:.1f} ({cell.output_tok_s / base:.2f}x{late})")
            rows.append(
                f"| {server} | {concurrency} | {', '.join(f'{a:.1f}' for a in alone)} | " + " | ".join(shares) + " |"
            )
    return "\n".join(rows)


def neighbour(text: str) -> tuple[int, int]:
    """COUNT@NICE, e.g. 2@19."""
    try:
        count, nice = (int(part) for part in text.split("@"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNT@NICE, e.g. 1@19") from error
    if count < 1 or not -20 <= nice <= 19:
        raise argparse.ArgumentTypeError(f"{text!r}: COUNT at least 1, NICE within -20..19")
    return count, nice


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shared_machine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=["specserve", "specserve-draft"])
    parser.add_argument("--vllm", default=None, help="vLLM's CLI, for the vllm server")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, for the llamacpp server")
    parser.add_argument("--llama-slots", type=int, default=16, help="llama-server's parallel slots")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="for specserve and vLLM (default: specserve's on this machine)",
    )
    parser.add_argument(
        "--specserve-args", default="", help="more flags for `specserve up`, e.g. '--quantization q4_1'"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--neighbours",
        type=neighbour,
        nargs="+",
        default=list(NEIGHBOURS),
        metavar="COUNT@NICE",
        help="busy processes and their nice value, e.g. 1@0 1@19 (default: 1@0 1@19 2@0 2@19)",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cell-timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    if "vllm" in args.servers and not args.vllm:
        parser.error("--servers vllm needs --vllm")
    if "llamacpp" in args.servers and not args.llama_server:
        parser.error("--servers llamacpp needs --llama-server")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from modeling.model.engine import default_dtype
    from modeling.model.store import default_model_dir
    from common.text.tokenizer import Tokenizer

    args.folder = default_model_dir()
    args.gguf = args.folder / "model.gguf"  # the GGUF file the folder was converted from
    args.dtype = args.dtype or default_dtype("cpu")
    tokenizer = Tokenizer.load(args.folder)
    work_dir = Path(tempfile.mkdtemp(prefix="specserve-shared-machine-"))
    cells: list[Cell] = []
    try:
        for server in args.servers:
            cells += measure_server(server, args, work_dir, lambda text: len(tokenizer.encode_raw(text)))
    except (StackError, subprocess.CalledProcessError, OSError) as error:
        print(f"error: {error} (logs in {work_dir})", file=sys.stderr)
        print(format_table(cells))
        return 1
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; model {args.folder.name}, "
        f"dtype {args.dtype}; chat prompts, {args.output_len} output tokens each, greedy, end of sequence ignored; "
        f"tok/s, and as a share of the server's own alone (the mean of before and after)"
    )
    print(format_table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
