"""A draft head measured in one process, without the sockets: how often it is right, and what a cycle gains.

    python bench/draft_head.py accuracy --draft drafts/SmolLM2-135M-Instruct [--draft OTHER_HEAD ...]
    python bench/draft_head.py cycle --draft drafts/SmolLM2-135M-Instruct --k 0 1 2 3 4 [--lookup-k 6 [--no-phrases]]

`accuracy`: the target answers the chat and code workloads (bench/spec_prompts.py)
greedily; each head then reads those answers teacher-forced, and the figure is how often
its first draft token is the target's next token, over the answer positions only. This
is what decides acceptance.

`cycle`: the target's runner and the draft's proposer called directly, one request at a
time: plain decoding, then propose-and-verify cycles with k draft tokens (with
`--lookup-k`, prompt lookup first, then the draft folder's phrases unless `--no-phrases`,
and the head where neither matches, as `eagle+phrases` (`eagle+ngram` with `--no-phrases`); k = 0 there: no
head, as `phrases`).
Reports accepted tokens per verify and the speed-up over plain decoding in the same run
(the absolute times on a shared machine move between runs; their ratio much less).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.spec_prompts import CHAT, CODE
from common.process_config import ProcessConfig
from distill.data import generate
from draft_service.head_proposer import EagleProposer
from draft_service.lookup_then_head import LookupThenHead
from draft_service.phrase_proposer import PhraseProposer
from draft_service.prompt_lookup import LookupProposer, NgramProposer
from draft_service.proposer import ProposeInput, Proposer
from common.text.tokenizer import ChatMessage, Tokenizer
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.eagle import EagleEngine
from modeling.model.engine import ModelEngine
from modeling.model.features import from_rows
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, pages_for_slots, slot_pages
from modeling.model.store import default_model_dir
from proto.messages import SamplingParams, SeqWork

GREEDY = SamplingParams()
MAX_LEN = 1024


def accuracy(target: Path, drafts: list[Path], dtype: str, output_len: int) -> None:
    tokenizer = Tokenizer.load(target)
    engine = ModelEngine(
        target,
        ModelConfig.from_folder(target),
        device="cpu",
        dtype=dtype,
        num_pages=pages_for_slots(16, MAX_LEN),
        max_len=MAX_LEN,
    )
    engine.load()
    engine.allocate()
    workloads = {"chat": CHAT, "code": CODE}
    answers = {
        name: generate(
            engine,
            [tokenizer.encode_chat([ChatMessage("user", q)]) for q in texts],
            output_len,
            set(tokenizer.eos_token_ids),
        )
        for name, texts in workloads.items()
    }
    for draft in drafts:
        head = EagleEngine(
            draft, target, device="cpu", dtype=dtype, num_pages=pages_for_slots(1, MAX_LEN), max_len=MAX_LEN
        )
        head.load()
        head.allocate()
        assert head.draft_vocab is not None
        figures = []
        for name, sequences in answers.items():
            right = total = 0
            for seq in sequences:
                n = len(seq.tokens)
                # Row j reads (f_j, x_{j+1}) and proposes x_{j+2}; answers start at seq.first_generated.
                logits, _ = head.forward(
                    [SeqSpan(slot_pages(0, MAX_LEN), 0, seq.tokens[1 : n - 1], n - 2)], seq.features[: n - 2]
                )
                proposed = head.draft_vocab[logits.argmax(-1)]
                first = max(0, seq.first_generated - 2)
                right += int((proposed[first:] == torch.tensor(seq.tokens[2:])[first:]).sum())
                total += n - 2 - first
            figures.append(f"{name} {right / total:.3f}")
        print(f"{draft}: first-token accuracy on the answers: {', '.join(figures)}")


def cycle(
    target: Path, draft: Path, dtype: str, ks: list[int], lookup_k: int, ngram_min: int, phrases: bool, output_len: int
) -> None:
    process = ProcessConfig(
        worker_id="bench",
        scheduler_address="inproc://unused",
        device="cpu",
        dtype=dtype,
        heartbeat_interval_s=1.0,
        phase_timeout_s=60.0,
        step_timeout_s=60.0,
        drain_timeout_s=10.0,
        num_threads=0,
        status_file=None,
    )
    config = WorkerConfig(
        process=process,
        model=target,
        max_model_len=MAX_LEN,
        kv_cache_memory_gib=None,
        page_size=DEFAULT_PAGE_SIZE,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        max_draft_tokens=8,
    )
    runner = ModelRunner(config, ModelConfig.from_folder(target), pages_for_slots(1, MAX_LEN))
    pages = list(slot_pages(0, MAX_LEN))
    runner.load()
    runner.allocate()
    head = EagleProposer(
        draft, target, device="cpu", dtype=dtype, num_seqs=1, max_len=MAX_LEN, max_draft_tokens=8, draft_top_k=8
    )
    for phase in head.phases():
        phase()
    tokenizer = Tokenizer.load(target)
    workloads = {"chat": CHAT, "code": CODE}
    prompts = {
        name: [tokenizer.encode_chat([ChatMessage("user", q)]) for q in texts] for name, texts in workloads.items()
    }

    def decode(prompt: list[int], proposer: Proposer | None, k: int) -> tuple[list[int], float, int, int]:
        """-> (tokens, seconds after the prefill, verify steps, accepted draft tokens)."""
        head.forget("r")
        (out,), (rows,), _ = runner.execute([SeqWork("r", pages, 0, prompt, True, GREEDY)], return_features=True)
        tokens, features = prompt + out.token_ids, from_rows(rows.rows)
        stable, seconds, verifies, accepted = 0, 0.0, 0, 0
        while len(tokens) < len(prompt) + output_len:
            started = time.perf_counter()
            drafted: list[int] = []
            parents = None  # a token tree's (the phrases propose them to greedy requests)
            if proposer is not None:
                (proposal,) = proposer.propose([ProposeInput("r", tokens, stable, k, GREEDY, features)])
                drafted, parents = proposal.token_ids, proposal.parents
            work = SeqWork(
                "r",
                pages,
                len(tokens) - 1,
                [tokens[-1]] + drafted,
                True,
                GREEDY,
                num_draft_tokens=len(drafted),
                draft_parents=parents,
            )
            (out,), step_rows, _ = runner.execute([work], return_features=proposer is not None)  # plain steps need none
            seconds += time.perf_counter() - started
            verifies += bool(drafted)
            accepted += out.num_accepted_draft
            if step_rows:
                features = torch.cat((features, from_rows(step_rows[0].rows)))
            stable = len(tokens) + out.num_accepted_draft
            tokens = tokens + out.token_ids
        return tokens, seconds, verifies, accepted

    label = (
        f"lookup (n >= {ngram_min}, k = {lookup_k}){', phrases' if phrases else ''}, else the head"
        if lookup_k
        else "the head"
    )
    print(f"{draft} ({dtype}), {label}")
    ngram = NgramProposer(ngram_min, 4)
    lookup: LookupProposer = ngram
    if phrases:
        lookup = PhraseProposer(draft, target, ngram)
        for phase in lookup.phases():
            phase()
    for k in ks:
        proposer: Proposer = head
        if lookup_k:
            proposer = LookupThenHead(head, lookup, k) if k else lookup
        for name, group in prompts.items():
            # Each prompt plainly, then speculating, in turn: a machine that slows down mid-run slows both alike.
            plain, runs = [], []
            for prompt in group:
                plain.append(decode(prompt, None, 0))
                runs.append(decode(prompt, proposer, lookup_k or k))
            same = sum(run[0][: len(base[0])] == base[0][: len(run[0])] for run, base in zip(runs, plain))
            speed_up = sum(base[1] for base in plain) / sum(run[1] for run in runs)
            per_verify = sum(run[3] for run in runs) / max(1, sum(run[2] for run in runs))
            print(
                f"  head k = {k}, {name}: accepted per verify {per_verify:.2f}, speed-up {speed_up:.2f}x, "
                f"identical {same}/{len(group)}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("accuracy", "cycle"))
    parser.add_argument(
        "--draft", type=Path, action="append", required=True, help="a head folder (repeatable for accuracy)"
    )
    parser.add_argument(
        "--target", type=Path, default=None, help="the target's folder (default: the embedded default model)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4],
        help="cycle: the head's draft tokens (0 with --lookup-k: the lookups alone)",
    )
    parser.add_argument(
        "--lookup-k", type=int, default=0, help="cycle: prompt lookup's draft tokens before the head (0: none)"
    )
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument(
        "--no-phrases", action="store_true", help="cycle: with --lookup-k, leave out the folder's phrases"
    )
    parser.add_argument("--output-len", type=int, default=None, help="default: 128 for accuracy, 64 for cycle")
    args = parser.parse_args(argv)
    target = args.target or default_model_dir()
    if args.mode == "accuracy":
        accuracy(target, args.draft, args.dtype, args.output_len or 128)
    else:
        cycle(
            target,
            args.draft[0],
            args.dtype,
            args.k,
            args.lookup_k,
            args.ngram_min,
            not args.no_phrases,
            args.output_len or 64,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
