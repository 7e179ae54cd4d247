"""What the suffix store (draft_service/suffix_store.py) costs: insert time per token, lookup time per sequence and
the process's memory, with N tokens stored.

The text is made to look like traffic: documents of 500 tokens drawn from a Zipf law over a
49,152-token vocabulary, a tenth of each copied from an earlier document (repeated phrases), ten
tenants. Each size runs in a process of its own, so its peak memory is its own.

    python -m bench.suffix_store --tokens 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

VOCAB = 49_152
DOCUMENT = 500
TENANTS = 10


def _documents(count: int, rng: np.random.Generator) -> list[list[int]]:
    documents: list[list[int]] = []
    for _ in range(count):
        tokens = (rng.zipf(1.3, DOCUMENT) % VOCAB).tolist()
        if documents:  # a tenth copied from an earlier document
            source = documents[int(rng.integers(len(documents)))]
            start = int(rng.integers(DOCUMENT - DOCUMENT // 10))
            tokens[start : start + DOCUMENT // 10] = source[start : start + DOCUMENT // 10]
        documents.append(tokens)
    return documents


def measure(num_tokens: int, lookups: int) -> dict[str, float]:
    from draft_service.suffix_store import SuffixStore, guesses

    rng = np.random.default_rng(0)
    documents = _documents(num_tokens // DOCUMENT, rng)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = SuffixStore(num_tokens, VOCAB)
    started = time.perf_counter()
    for index, document in enumerate(documents):
        store.add(f"tenant-{index % TENANTS}", document)
    inserted_s = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(lookups):
        document = documents[int(rng.integers(len(documents)))]
        end = int(rng.integers(16, DOCUMENT))
        found = store.match(f"tenant-{index % TENANTS}", document[:end], 6)
        if found is not None:
            guesses(found, 6, min_chance=0.02)
    lookup_s = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "tokens": store.num_tokens,
        "insert_us_per_token": inserted_s / store.num_tokens * 1e6,
        "lookup_ms_per_sequence": lookup_s / lookups * 1e3,
        "store_mib": (peak_kib - baseline_kib) / 1024,
        "rss_mib": peak_kib / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--lookups", type=int, default=5000)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a size, measured in this process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.lookups)))
        return
    print("| tokens stored | insert, us a token | lookup, ms a sequence | store, MiB | process RSS, MiB |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.tokens:
        command = [sys.executable, "-m", "bench.suffix_store", "--one", str(size), "--lookups", str(args.lookups)]
        row = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        print(
            f"| {row['tokens']:,} | {row['insert_us_per_token']:.2f} | {row['lookup_ms_per_sequence']:.3f} "
            f"| {row['store_mib']:.0f} | {row['rss_mib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
