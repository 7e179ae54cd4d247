"""lm-evaluation-harness against a real stack, as a user runs it: `lm_eval run --model local-completions` on tasks
whose data files the test writes (nothing is downloaded).

A multiple-choice task scores each choice with `echo` + `logprobs` (the log-likelihood of
the continuation after the context); those must equal the model's own, computed here with
transformers on the same weights. A generate-until task reads greedy text, which must
equal the server's own greedy text for the same prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proto import specserve_pb2 as pb
from tests.e2e.reference import ReferenceModel
from tests.e2e.stack import Stack
from tests.e2e.test_http_api import MODEL

TOLERANCE = 2e-3  # per continuation, summed over its tokens: float32 kernels other than transformers'

CHOICES = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},  # " " goes between
    {"question": "Two plus two equals", "choices": ["four", "seven", "a banana"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["Spain", "France", "the moon"], "answer": 1},
]
UNTIL = [
    {"question": "Q: What colour is grass?\nA:", "answer": " green"},
    {"question": "Q: How many legs does a cat have?\nA:", "answer": " four"},
]


def write_tasks(folder: Path) -> None:
    for name, rows in (("choice", CHOICES), ("until", UNTIL)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: PATH\ntest_split: test\n"
        'doc_to_text: "{{question}}"\n'
    )
    (folder / "choice.yaml").write_text(
        "task: specserve_choice\n"
        + common.replace("PATH", str(folder / "choice.jsonl"))
        + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        + "metric_list:\n  - metric: acc\n"
    )
    (folder / "until.yaml").write_text(
        "task: specserve_until\n"
        + common.replace("PATH", str(folder / "until.jsonl"))
        + 'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n'
        + "metric_list:\n  - metric: exact_match\n"
    )


def samples(output: Path, task: str) -> list[dict[str, object]]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_scores_log_likelihoods_and_generates_through_the_server(
    fp32_stack: Stack, default_model_dir: Path, tmp_path: Path
) -> None:
    write_tasks(tmp_path)
    url = f"http://127.0.0.1:{fp32_stack.addresses.http_port}/v1/completions"
    model_args = (
        f"model={MODEL},base_url={url},tokenizer_backend=huggingface,tokenizer={default_model_dir},"
        "num_concurrent=1,max_retries=1,timeout=120"
    )
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "lm_eval"),
            "run",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "specserve_choice",
            "specserve_until",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    reference = ReferenceModel(default_model_dir, torch.float32)
    scored = samples(tmp_path / "out", "specserve_choice")
    assert len(scored) == len(CHOICES)
    for sample in scored:
        arguments = sample["arguments"].values()  # type: ignore[attr-defined]
        for args, ((log_likelihood, is_greedy),) in zip(arguments, sample["resps"]):  # type: ignore[call-overload]
            context, continuation = args["arg_0"], args["arg_1"]
            log_likelihood, is_greedy = float(log_likelihood), is_greedy in (True, "True")
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            continuation_ids = tokenizer(continuation, add_special_tokens=False).input_ids
            log_probs = reference.log_softmax(context_ids + continuation_ids)
            expected = sum(
                float(log_probs[len(context_ids) - 1 + i, token]) for i, token in enumerate(continuation_ids)
            )
            assert log_likelihood == pytest.approx(expected, abs=TOLERANCE), (context, continuation)
            greedy = all(
                int(torch.argmax(log_probs[len(context_ids) - 1 + i])) == token
                for i, token in enumerate(continuation_ids)
            )
            assert is_greedy == greedy
    generated = samples(tmp_path / "out", "specserve_until")
    assert len(generated) == len(UNTIL)
    for sample in generated:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]  # type: ignore[index]
        ((text,),) = sample["resps"]  # type: ignore[misc]
        own = fp32_stack.generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=tokenizer(prompt, add_special_tokens=False).input_ids),
                params=pb.SamplingParams(max_tokens=12, stop=["\n"]),
            )
        ).text
        assert text == own
