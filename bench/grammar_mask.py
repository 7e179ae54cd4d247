"""The cost of a grammar's token mask on this CPU: llguidance (what specserve runs) and, when it is installed,
outlines-core, on the embedded model's tokenizer.

For each JSON schema of bench/structured_bench.py it compiles the schema, then walks a
valid compact JSON document token by token, computing the mask before each token, and
reports the compile time and the mean and largest mask time per token (the first mask of
a grammar included), and the cost of rolling five tokens back.

    python bench/grammar_mask.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance

from bench.machine_info import describe_machine
from bench.structured_bench import SCHEMAS
from modeling.model.store import default_model_dir
from common.text.structured import StructuredSpec, compile_spec, grammar_tokenizer
from common.text.tokenizer import Tokenizer

DOCUMENTS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    "order": {"id": 17, "status": "paid", "items": [{"sku": "apple", "quantity": 2}, {"sku": "pear", "quantity": 1}]},
    "profile": {"user": {"handle": "ada", "favourite_colours": ["red", "blue"]}, "active": True, "member_since": 2001},
}


def llguidance_costs(tokenizer: Tokenizer, tokens: list[int], schema: dict[str, Any]) -> dict[str, float]:
    started = time.perf_counter()
    lltokenizer = grammar_tokenizer(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(
        lltokenizer, compile_spec(StructuredSpec("json_schema", json.dumps(schema)), lltokenizer)
    )
    compile_s = time.perf_counter() - started
    times = []
    for token in tokens:
        started = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    started = time.perf_counter()
    assert matcher.rollback(5)
    rollback_s = time.perf_counter() - started
    return {
        "tokenizer_s": round(tokenizer_s, 3),
        "compile_ms": round(compile_s * 1e3, 2),
        "mask_mean_us": round(statistics.mean(times) * 1e6, 1),
        "mask_median_us": round(statistics.median(times) * 1e6, 1),
        "mask_max_us": round(max(times) * 1e6, 1),
        "rollback_5_us": round(rollback_s * 1e6, 1),
    }


def outlines_costs(tokenizer: Tokenizer, tokens: list[int], schema: dict[str, Any]) -> dict[str, float] | None:
    try:
        import numpy as np
        import outlines_core
    except ImportError:
        return None
    vocabulary = _byte_vocabulary(tokenizer)
    started = time.perf_counter()
    eos = tokenizer.eos_token_ids[0]
    index = outlines_core.Index(
        outlines_core.json_schema.build_regex_from_schema(json.dumps(schema)),
        outlines_core.Vocabulary(eos, {k: v for k, v in vocabulary.items() if eos not in v}),
    )
    compile_s = time.perf_counter() - started
    guide = outlines_core.Guide(index, max_rollback=16)
    mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    times = []
    for token in tokens:
        started = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - started)
        guide.advance(token)
    return {
        "compile_ms": round(compile_s * 1e3, 2),
        "mask_mean_us": round(statistics.mean(times) * 1e6, 1),
        "mask_median_us": round(statistics.median(times) * 1e6, 1),
        "mask_max_us": round(max(times) * 1e6, 1),
    }


def _byte_vocabulary(tokenizer: Tokenizer) -> dict[bytes, list[int]]:
    """A byte-level BPE vocabulary as bytes (the inverse of GPT-2's byte-to-character table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    vocabulary: dict[bytes, list[int]] = {}
    for text, token in json.loads(tokenizer.backend_json())["model"]["vocab"].items():
        if all(ch in table for ch in text):
            vocabulary.setdefault(bytes(table[ch] for ch in text), []).append(token)
    return vocabulary


def main() -> int:
    tokenizer = Tokenizer.load(default_model_dir())
    report: dict[str, Any] = {"machine": describe_machine(None, "cpu"), "schemas": {}}
    for name, schema in SCHEMAS.items():
        tokens = tokenizer.encode_raw(json.dumps(DOCUMENTS[name], separators=(",", ":")))
        report["schemas"][name] = {
            "num_tokens": len(tokens),
            "llguidance": llguidance_costs(tokenizer, tokens, schema),
            "outlines_core": outlines_costs(tokenizer, tokens, schema),
        }
        print(name, json.dumps(report["schemas"][name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
