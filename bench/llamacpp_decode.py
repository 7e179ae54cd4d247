"""llama.cpp's plain decoding at batch 1 on a GGUF file: the CPU users' reference (docs/benchmarks.md).

Runs in llama-cpp-python's own venv (recipe: ../shared/bench-clients.md), so it imports
nothing of specserve. The workload is `bench.grpc_bench`'s at concurrency 1: prompts of
`--input-len` tokens of English text, `--output-len` tokens each, greedy, end of sequence
ignored; tok/s is completion tokens over the wall time of all requests, one at a time,
after one unmeasured warm-up request. The prompts are windows of bench/prompts.py's essay,
61 tokens apart, read from `--prompt-file` and cut by llama.cpp's own tokenizer:

    .venv/bin/python -c "from bench.prompts import ESSAY_TEXT; print(ESSAY_TEXT)" > /tmp/essay.txt
    /tmp/llamacpp/bin/python bench/llamacpp_decode.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompt-file /tmp/essay.txt --threads 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llama_cpp import Llama  # type: ignore[import-not-found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    llm = Llama(
        model_path=str(args.model),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    text = llm.tokenize(args.prompt_file.read_text().encode(), add_bos=False)
    prompts = [text[i * 61 : i * 61 + args.input_len] for i in range(args.num_prompts + 1)]

    def generate(prompt: list[int]) -> int:
        llm.reset()
        count = 0
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if count == args.output_len:
                break
            del token
        return count

    generate(prompts[0])  # warm-up
    started = time.perf_counter()
    tokens = sum(generate(prompt) for prompt in prompts[1:])
    elapsed = time.perf_counter() - started
    print(
        f"llama.cpp {args.model.name}, {args.threads} threads: {tokens} tokens in {elapsed:.2f} s, "
        f"{tokens / elapsed:.1f} tok/s, {elapsed / tokens * 1e3:.2f} ms a token (prefill included)"
    )


if __name__ == "__main__":
    main()
