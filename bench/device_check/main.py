"""The check's command line and its order: the environment, the model, Hugging Face's references, then each session's
stack and parts."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.device_check.model import ModelChoice, Reference, choose_model, environment, references
from bench.device_check.parts import capture_fault, greedy, kill_worker, throughput
from bench.device_check.report import DEVICE, DRY_RUN, Budget, Outcome, Report, Sizes, describe_error, keep_logs
from bench.device_check.report import print_summary, run_part
from bench.device_check.stacks import Part, Served, Session, run_session
from bench.machine_info import describe_machine
from bench.prompts import PromptWindows
from bench.spec_prompts import CHAT, CODE

REPO = Path(__file__).resolve().parents[2]
MODEL_SHAPE_DIR = REPO / ".device" / "model-shape"  # the embedded model's small files, carried to the device
PROMPTS = CHAT[:5] + CODE[:5]
DESCRIPTION = (
    "The device check: one run that serves the embedded model's shape on a GPU, with and without CUDA graphs, and "
    "writes one JSON summary of what held."
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.device_check", description=DESCRIPTION)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, small sizes (the recording backend)")
    parser.add_argument("--json-out", type=Path, default=Path("device_check.json"))
    parser.add_argument("--budget-s", type=float, default=None, help="the whole check's time (default: 420, dry 330)")
    parser.add_argument("--model-dir", type=Path, default=None, help="a Hugging Face Llama folder to serve")
    parser.add_argument(
        "--random-weights", action="store_true", help="random weights even where the model store has the model"
    )
    parser.add_argument("--model-shape", type=Path, default=MODEL_SHAPE_DIR, help="config and tokenizer files")
    return parser.parse_args(argv)


def sessions(sizes: Sizes, refs: list[Reference], prompts: PromptWindows, draft: str, budget: Budget) -> list[Session]:
    """The stacks, correctness first: each part's stack, flags and what it needs of the budget."""

    def measured(concurrencies: Sequence[int], draft: str) -> Callable[[Served], Outcome[None]]:
        return lambda served: throughput(served, prompts, sizes, concurrencies, draft, budget)

    float32 = ("--dtype", "float32", "--draft", "none")
    return [
        Session(
            "float32-graphs-on",
            (*float32, "--cuda-graphs", "on"),
            (
                Part("greedy_graphs_on", 40, lambda served: greedy(served, refs, budget)),
                Part("capture_fault", 90, lambda served: capture_fault(served, budget)),
            ),
        ),
        Session(
            "float32-graphs-off",
            (*float32, "--cuda-graphs", "off"),
            (Part("greedy_graphs_off", 40, lambda served: greedy(served, refs, budget)),),
        ),
        Session(
            "graphs-on-draft-none",
            ("--cuda-graphs", "on", "--draft", "none"),
            (
                Part("throughput_graphs_on_draft_none", 40, measured(sizes.concurrencies, "none")),
                Part("kill_worker", 60, lambda served: kill_worker(served, prompts, sizes, budget)),
            ),
        ),
        Session(
            f"graphs-on-draft-{draft}",
            ("--cuda-graphs", "on", "--draft", draft),
            (Part("throughput_graphs_on_draft_default", 40, measured(sizes.concurrencies, draft)),),
        ),
        Session(
            "graphs-off-draft-none",
            ("--cuda-graphs", "off", "--draft", "none"),
            (Part("throughput_graphs_off_draft_none", 20, measured(sizes.concurrencies[:1], "none")),),
        ),
    ]


def default_draft_for(model_dir: Path) -> tuple[str, str]:
    """`default`, or where it cannot serve this model (its phrases were made for the embedded model's own weights),
    `suffix`: the same lookups without them. Returns the draft and why."""
    from specserve.draft_choice import draft_problem, parse_draft

    proposer = parse_draft("default").proposer
    problem = draft_problem(proposer, model_dir) if proposer is not None else ""
    if not problem:
        return "default", "the default draft"
    return "suffix", f"default cannot serve this model ({problem}); suffix is its lookups without the shipped phrases"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = DRY_RUN if args.dry_run else DEVICE
    budget = Budget(args.budget_s or sizes.budget_s)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="specserve-device-check-"))
    header = {
        "check": "specserve device check (bench/device_check.sh)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.orig_argv),
        "dry_run": args.dry_run,
        "budget_s": budget.seconds,
        "sizes": asdict(sizes),
        "machine": describe_machine(None, sizes.device),
    }
    report = Report(args.json_out, budget, header)
    try:
        check(report, budget, args, sizes, work_dir)
    except KeyboardInterrupt:  # the shell's hard limit: what was found is kept
        report.header["interrupted"] = True
    except Exception as error:  # outside any part (the prompts, the draft's choice): the parts' results are kept
        report.header["error"] = describe_error(error)
    finally:
        report.write()
        keep_logs(work_dir / "logs", args.json_out.parent / "stack-logs.tar.gz")
        shutil.rmtree(work_dir, ignore_errors=True)
    document = report.document()
    print_summary(document)
    print(f"wrote {args.json_out}", flush=True)
    return 0 if document["passed"] else 1


def check(report: Report, budget: Budget, args: argparse.Namespace, sizes: Sizes, work_dir: Path) -> None:
    """The parts in order, what later parts need (the model, Hugging Face's answers) first."""
    run_part(report, budget, "environment", 0, lambda: environment(sizes.device))
    model = run_part(report, budget, "model", 30, lambda: model_part(args, work_dir))
    if model is None:
        return
    reference_device = "cuda:0" if sizes.device == "cuda" and torch.cuda.is_available() else "cpu"
    refs = run_part(report, budget, "references", 40, lambda: references_part(model.path, sizes, reference_device))
    draft, why = default_draft_for(model.path)
    report.header["draft_against_none"] = {"draft": draft, "why": why}
    prompts = PromptWindows.from_model_folder(model.path, sizes.input_tokens)
    base_flags = ["--model", str(model.path), "--device", sizes.device, "--host", "127.0.0.1", *sizes.up_flags]
    for session in sessions(sizes, refs or [], prompts, draft, budget):
        run_session(report, budget, session, sizes, base_flags, work_dir / "logs")


def model_part(args: argparse.Namespace, work_dir: Path) -> Outcome[ModelChoice]:
    choice = choose_model(args.model_dir, args.random_weights, args.model_shape, work_dir)
    return Outcome(True, {"path": str(choice.path), "source": choice.source, "note": choice.note}, choice)


def references_part(model_dir: Path, sizes: Sizes, device: str) -> Outcome[list[Reference]]:
    refs = references(model_dir, PROMPTS, sizes.greedy_tokens, device)
    return Outcome(True, {"device": device, "prompt_lens": [len(ref.prompt_ids) for ref in refs]}, refs)
