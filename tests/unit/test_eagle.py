"""The EAGLE-style draft head: training form against serving form, target checks, the proposer,
and a short distillation.

All on the tiny random target from tests/conftest.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from distill.data import write_requests
from distill.arguments import DistillArgs
from distill.checkpoints import ResumeMismatch
from distill.train import run
from draft_service.head_proposer import EagleProposer
from draft_service.lookup_then_head import LookupThenHead
from draft_service.phrase_proposer import PhraseProposer
from draft_service.prompt_lookup import NgramProposer
from draft_service.proposer import ProposeInput, Proposer
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.kv_cache import pages_for_slots, slot_pages
from modeling.model.eagle import DraftMismatch, EagleEngine, EagleHead, check_target, unsupported_target
from modeling.model.engine import ModelEngine
from modeling.model.checkpoint import read_safetensors
from common.text.phrases import PhraseError, PhraseStore
from proto.messages import SamplingParams
from tests.eagle_helpers import tiny_head

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EagleHead, Path]:
    head = tiny_head(tiny_llama_folder)
    folder = tmp_path_factory.mktemp("eagle") / "draft"
    head.save(folder, tiny_llama_folder, {"note": "untrained, for tests"})
    return head, folder


def test_the_serving_engine_computes_what_the_training_head_computes(
    tiny_llama_folder: Path, tiny_draft: tuple[EagleHead, Path]
) -> None:
    head, folder = tiny_draft
    engine = EagleEngine(
        folder, tiny_llama_folder, device="cpu", dtype="float32", num_pages=pages_for_slots(2, 64), max_len=64
    )
    engine.load()
    engine.allocate()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(9, 64, generator=generator)
    tokens = torch.randint(0, 97, (9,), generator=generator)
    with torch.no_grad():
        expected = head(features[None], tokens[None])[0]  # [9, H]
    # A prefill of 6 pairs in slot 1, then 3 one-pair steps: the slot cache must give the same as one full pass.
    logits, predicted = engine.forward([SeqSpan(slot_pages(1, 64), 0, tokens[:6].tolist(), 6)], features[:6])
    torch.testing.assert_close(predicted, expected[:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, head.draft_logits(expected[:6]), atol=1e-3, rtol=1e-4)
    for position in range(6, 9):
        _, predicted = engine.forward(
            [SeqSpan(slot_pages(1, 64), position, [int(tokens[position])], 1)], features[position : position + 1]
        )
        torch.testing.assert_close(predicted[0], expected[position], atol=1e-4, rtol=1e-4)
    assert engine.draft_vocab is not None and torch.equal(
        engine.draft_vocab[torch.tensor([0, 1, 5])], torch.tensor([0, 2, 10])
    )


def test_a_draft_for_another_target_is_refused(
    tiny_llama_folder: Path, tiny_draft: tuple[EagleHead, Path], tmp_path: Path
) -> None:
    _, folder = tiny_draft
    assert check_target(folder, tiny_llama_folder).draft_vocab_size == 49
    other = _other_target(tiny_llama_folder, tmp_path)
    with pytest.raises(DraftMismatch, match="another target model"):
        check_target(folder, other)
    with pytest.raises(DraftMismatch, match="another target model"):
        EagleProposer(
            folder, other, device="cpu", dtype="float32", num_seqs=1, max_len=64, max_draft_tokens=2, draft_top_k=4
        )
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 98
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftMismatch, match="vocabulary"):
        check_target(folder, other)


def _other_target(target: Path, tmp_path: Path) -> Path:
    """A copy of the target with another rope_theta: the same vocabulary, another model."""
    other = tmp_path / "other_target"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}  # as transformers 5 writes it
    config.pop("rope_theta", None)
    (other / "config.json").write_text(json.dumps(config))
    return other


def _built(folder: Path, target: Path, num_slots: int = 2) -> EagleProposer:
    proposer = EagleProposer(
        folder, target, device="cpu", dtype="float32", num_seqs=num_slots, max_len=64, max_draft_tokens=4, draft_top_k=8
    )
    for phase in proposer.phases():
        phase()
    return proposer


def test_the_proposer_proposes_from_the_draft_vocabulary_and_follows_the_sequence(
    tiny_llama_folder: Path,
    tiny_draft: tuple[EagleHead, Path],
) -> None:
    head, folder = tiny_draft
    proposer = _built(folder, tiny_llama_folder)
    assert proposer.num_used_kv_pages == 0  # warm-up forgot its sequences
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (12,), generator=generator).tolist()
    features = torch.randn(11, 64, generator=generator)
    (first,) = proposer.propose([ProposeInput("r", tokens, 0, 4, GREEDY, features)])
    assert len(first.token_ids) == 4 and all(t % 2 == 0 for t in first.token_ids)  # the draft vocabulary: even ids
    # Greedy proposals are the head's own chain: its argmax, fed back with its predicted feature.
    with torch.no_grad():
        f, x = features.clone(), list(tokens[1:])
        chain = []
        for _ in range(4):
            g = head(f[None], torch.tensor(x)[None])[0, -1]
            chain.append(int(head.draft_vocab[head.draft_logits(g).argmax()]))
            f, x = torch.cat((f, g[None])), x + [chain[-1]]
    assert first.token_ids == chain
    # The same sequence again, grown by two tokens (and their features): the stale proposal is recomputed.
    more = tokens + [first.token_ids[0], 7]
    more_features = torch.cat((features, torch.randn(2, 64, generator=generator)))
    (second,) = proposer.propose([ProposeInput("r", more, 13, 3, GREEDY, more_features)])
    (fresh,) = _built(folder, tiny_llama_folder).propose([ProposeInput("r", more, 0, 3, GREEDY, more_features)])
    assert second.token_ids == fresh.token_ids
    # Without every feature there is nothing sound to read: no proposal.
    (none,) = proposer.propose([ProposeInput("s", tokens, 0, 3, GREEDY, features[:5])])
    assert none.token_ids == []
    sampled = SamplingParams(temperature=1.0, seed=5)
    (drawn,) = proposer.propose([ProposeInput("t", tokens, 0, 3, sampled, features)])
    assert drawn.dists is not None and len(drawn.dists) == 3
    for token, dist in zip(drawn.token_ids, drawn.dists):
        assert token in dist.token_ids and abs(sum(dist.probs) - 1) < 1e-5 and all(t % 2 == 0 for t in dist.token_ids)


@pytest.fixture(scope="module")
def tiny_target_with_tokenizer(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target plus a 97-token BPE tokenizer trained here, so the command can render its prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from distill.prompts import training_prompts

    folder = tmp_path_factory.mktemp("tiny_with_tokenizer") / "target"
    shutil.copytree(tiny_llama_folder, folder)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=97, special_tokens=["<unk>", "<eos>"], initial_alphabet=[], show_progress=False
    )
    tokenizer.train_from_iterator(training_prompts(200), trainer)
    assert tokenizer.get_vocab_size() <= 97
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_short_distillation_lowers_the_loss_and_writes_a_draft_the_proposer_serves(
    tiny_target_with_tokenizer: Path, tmp_path: Path
) -> None:
    tiny_llama_folder = tiny_target_with_tokenizer
    out = tmp_path / "distilled"
    args = DistillArgs(
        target=tiny_llama_folder,
        out=out,
        dtype="float32",
        num_prompts=24,
        self_prompts=16,
        request_tokens=12,
        max_new_tokens=24,
        text_tokens=600,
        draft_vocab_size=64,
        steps=40,
        batch_sequences=8,
        lr=3e-3,
        checkpoint_every=20,
    )
    figures = run(args, log=lambda line: None)
    assert figures["train_cls_last"] < figures["train_cls_first"]
    # The target answered the 24 shipped requests and the 16 it wrote itself (all distinct here).
    saved = torch.load(out / "training" / "data.pt", weights_only=False)
    answered = [s for s in saved["sequences"] if s["first_generated"] < len(s["tokens"])]
    assert len(answered) == 24 + 16
    assert (out / "training" / "checkpoint.pt").exists() and (out / "training" / "data.pt").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["specserve_eagle"]["training"]["arguments"]["steps"] == 40
    proposer = _built(out, tiny_llama_folder, num_slots=1)
    (proposal,) = proposer.propose([ProposeInput("r", [1, 2, 3, 4], 0, 3, GREEDY, torch.randn(3, 64))])
    assert len(proposal.token_ids) == 3
    # Beside the head, the answered sequences as phrases; eagle+phrases continues one of them from its own words.
    assert figures["phrase_tokens"] == sum(len(s["tokens"]) for s in answered)
    phrases = PhraseProposer(out, tiny_llama_folder, NgramProposer(2, 4))
    hybrid = LookupThenHead(_built(out, tiny_llama_folder, num_slots=1), phrases, 2)
    for phase in hybrid.phases():
        phase()
    assert phrases.num_phrase_tokens == figures["phrase_tokens"]
    # Four distinct tokens (so prompt lookup finds nothing) followed by six more somewhere in the data.
    context = next(
        seq[j : j + 4]
        for seq in (s["tokens"] for s in answered)
        for j in range(len(seq) - 10)
        if len(set(seq[j : j + 4])) == 4
    )
    expected = PhraseStore.from_sequences([s["tokens"] for s in answered]).continue_(context, 6)
    (from_phrases,) = hybrid.propose([ProposeInput("q", context, 0, 6, GREEDY, torch.randn(3, 64))])
    assert from_phrases.token_ids == expected and len(expected) > 2  # longer than the head's 2
    # An interrupted run resumed from its checkpoint ends exactly where the uninterrupted one did.
    interrupted = DistillArgs(**{**args.__dict__, "out": tmp_path / "interrupted"})
    assert run(interrupted, log=lambda line: None, stop_after=20) == {}
    resumed = run(DistillArgs(**{**interrupted.__dict__, "resume": True}), log=lambda line: None)
    for name in ("train_cls_last", "held_out_reg", "held_out_cls", "held_out_top1"):
        assert resumed[name] == pytest.approx(figures[name], abs=1e-3), name
    with pytest.raises(ResumeMismatch, match="lr: 0.003 there, 0.01 now"):  # names what differs
        run(DistillArgs(**{**interrupted.__dict__, "resume": True, "lr": 1e-2}), log=lambda line: None)
    # The target is known by its fingerprints, not its path; how often checkpoints are written changes no result.
    moved = tmp_path / "moved-target"
    shutil.copytree(tiny_llama_folder, moved)
    again = run(
        DistillArgs(**{**interrupted.__dict__, "resume": True, "target": moved, "checkpoint_every": 7}),
        log=lambda line: None,
    )
    assert again["held_out_top1"] == pytest.approx(figures["held_out_top1"], abs=1e-3)
    (interrupted.out / "training" / "checkpoint.pt").write_bytes(b"half a file")  # a crash while it was written
    with pytest.raises(ResumeMismatch, match="cannot be read"):
        run(DistillArgs(**{**interrupted.__dict__, "resume": True}), log=lambda line: None)


def _saved_head(folder: Path, target: Path) -> EagleHead:
    """The training form of the head saved in `folder`."""
    weights = read_safetensors(folder)
    embed = read_safetensors(target, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    head = EagleHead(ModelConfig.from_folder(target), embed, weights["draft_vocab"].long())
    head.init_layer_from(weights, 0, weights["model.norm.weight"])
    with torch.no_grad():
        head.fc.copy_(weights["fc.weight"].float())
    return head


@pytest.fixture(scope="module")
def tiny_llama3_target(tiny_target_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama 3.x-style target: the tiny target's shape with Llama 3's RoPE scaling, and the same tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    folder = tmp_path_factory.mktemp("tiny_llama3") / "target"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(tiny_target_with_tokenizer / "tokenizer.json", folder / "tokenizer.json")
    assert ModelConfig.from_folder(folder).rope_scaling is not None
    return folder


def test_a_head_distilled_for_a_llama3_target_serves_what_it_learned(tiny_llama3_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "distilled"
    args = DistillArgs(
        target=tiny_llama3_target,
        out=out,
        dtype="float32",
        num_prompts=12,
        self_prompts=4,
        request_tokens=12,
        max_new_tokens=16,
        text_tokens=300,
        draft_vocab_size=64,
        steps=30,
        batch_sequences=8,
        lr=3e-3,
        checkpoint_every=30,
    )
    figures = run(args, log=lambda line: None)
    assert figures["train_cls_last"] < figures["train_cls_first"]
    # The serving engine, on the target's scaled RoPE, computes what the saved head computes in its training form.
    engine = EagleEngine(
        out, tiny_llama3_target, device="cpu", dtype="float32", num_pages=pages_for_slots(1, 64), max_len=64
    )
    engine.load()
    engine.allocate()
    features = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3))
    _, predicted = engine.forward([SeqSpan(slot_pages(0, 64), 0, tokens.tolist(), 20)], features)
    saved_head = _saved_head(out, tiny_llama3_target)
    with torch.no_grad():
        expected = saved_head(features[None], tokens[None])[0]
    torch.testing.assert_close(predicted, expected, atol=1e-4, rtol=1e-4)
    proposer = _built(out, tiny_llama3_target, num_slots=1)
    (proposal,) = proposer.propose([ProposeInput("r", [1, 2, 3, 4], 0, 3, GREEDY, torch.randn(3, 64))])
    assert len(proposal.token_ids) == 3


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model_type": "qwen3", "qk_norm": True}, "its qwen3 layers are not Llama's"),
        (
            {"model_type": "gemma3_text", "gemma": True, "hidden_act": "gelu_pytorch_tanh"},
            "its gemma3_text layers are not Llama's",
        ),
        ({"model_type": "mistral", "sliding_window": 16, "sliding_layers": (True, True, True)}, "sliding windows"),
        ({"o_bias": True}, "biases"),
        ({"tie_word_embeddings": False}, "not tied"),
    ],
)
def test_a_head_is_refused_for_a_target_whose_layers_it_does_not_copy(
    tiny_llama_folder: Path, changes: dict[str, Any], reason: str
) -> None:
    target = ModelConfig.from_folder(tiny_llama_folder)
    assert unsupported_target(target) == ""
    assert reason in unsupported_target(replace(target, **changes))


def test_distill_refuses_arguments_that_cannot_work_before_any_work(
    tiny_target_with_tokenizer: Path, tmp_path: Path
) -> None:
    from specserve.cli import _build_parser
    from distill.arguments import check_arguments

    parser = _build_parser()
    target = str(tiny_target_with_tokenizer)

    def refused(*extra: str) -> str:
        ns = parser.parse_args(["distill", "--target", target, "--out", str(tmp_path / "out"), *extra])
        with pytest.raises(SystemExit):
            check_arguments(parser, ns)
        return ns.target

    refused("--max-new-tokens", "100")  # the tiny target has 128 positions: no room left for the request
    refused("--num-prompts", "100000")
    refused("--device", "tpu")
    refused("--num-threads", "-1")
    ns = parser.parse_args(["distill", "--target", target, "--out", target])
    with pytest.raises(SystemExit):
        check_arguments(parser, ns)  # the draft's files would replace the target's
    ok = check_arguments(
        parser,
        parser.parse_args(["distill", "--target", target, "--out", str(tmp_path / "out"), "--max-new-tokens", "32"]),
    )
    assert ok.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_target_writes_requests_reproducibly_up_to_a_stop_id_or_the_length(tiny_llama_folder: Path) -> None:
    engine = ModelEngine(
        tiny_llama_folder,
        ModelConfig.from_folder(tiny_llama_folder),
        device="cpu",
        dtype="float32",
        num_pages=pages_for_slots(4, 64),
        max_len=64,
    )
    engine.load()
    engine.allocate()
    starts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11]]  # more starts than slots: two groups
    written = write_requests(engine, starts, 10, set(), seed=0)
    assert [len(r) for r in written] == [10] * 5
    assert written == write_requests(engine, starts, 10, set(), seed=0)
    assert written != write_requests(engine, starts, 10, set(), seed=1)
    assert len({tuple(r) for r in written}) == 5  # sampled, not greedy: the same model writes different requests
    # A stop id ends a request and is left out of it.
    (alone,) = write_requests(engine, starts[:1], 10, set(), seed=0)
    stop = alone[3]
    (stopped,) = write_requests(engine, starts[:1], 10, {stop}, seed=0)
    assert stopped == alone[: alone.index(stop)]


def test_lookup_then_head_looks_up_repeats_and_asks_the_head_elsewhere_which_catches_up(
    tiny_llama_folder: Path,
    tiny_draft: tuple[EagleHead, Path],
) -> None:
    _, folder = tiny_draft
    hybrid = LookupThenHead(_built(folder, tiny_llama_folder), NgramProposer(2, 4), head_tokens=2)
    load, allocate, warm_up = hybrid.phases()
    load(), allocate(), warm_up()  # the head is built already; warming again is harmless and checks the lookup
    generator = torch.Generator().manual_seed(4)
    tokens = [11, 13, 15, 17, 19, 21, 23, 25]  # nothing repeats: the head proposes, at most head_tokens
    features = torch.randn(len(tokens) - 1, 64, generator=generator)
    (first,) = hybrid.propose([ProposeInput("r", tokens, 0, 5, GREEDY, features)])
    (alone,) = _built(folder, tiny_llama_folder).propose([ProposeInput("r", tokens, 0, 2, GREEDY, features)])
    assert first.token_ids == alone.token_ids and len(first.token_ids) == 2
    # The sequence grows into a repeat of "15 17": the lookup proposes the whole k from its earlier continuation.
    grown = tokens + [3, 15, 17]
    grown_features = torch.cat((features, torch.randn(3, 64, generator=generator)))
    (looked,) = hybrid.propose([ProposeInput("r", grown, len(tokens), 5, GREEDY, grown_features)])
    assert looked.token_ids == [19, 21, 23, 25, 3] and looked.dists is None
    # Then no repeat again: the head, which skipped a step, catches up and proposes what a fresh head would.
    later = grown + [5, 7]
    later_features = torch.cat((grown_features, torch.randn(2, 64, generator=generator)))
    (caught_up,) = hybrid.propose([ProposeInput("r", later, len(grown), 5, GREEDY, later_features)])
    (fresh,) = _built(folder, tiny_llama_folder).propose([ProposeInput("r", later, 0, 2, GREEDY, later_features)])
    assert caught_up.token_ids == fresh.token_ids and len(fresh.token_ids) == 2
    assert hybrid.num_used_kv_pages > 0
    hybrid.forget("r")
    assert hybrid.num_used_kv_pages == 0


def test_the_phrase_proposer_looks_up_the_prompt_first_then_the_targets_phrases_and_checks_its_folder(
    tiny_llama_folder: Path,
    tiny_draft: tuple[EagleHead, Path],
    tmp_path: Path,
) -> None:
    _, made = tiny_draft
    folder = tmp_path / "draft"
    shutil.copytree(made, folder)
    without = PhraseProposer(folder, tiny_llama_folder, NgramProposer(2, 4))
    load, allocate, warm_up = without.phases()
    with pytest.raises(FileNotFoundError, match="phrases.safetensors"):
        load()
    PhraseStore.from_sequences([[40, 41, 42, 43, 44, 45], [50, 51, 52, 53]]).save(folder)
    proposer = PhraseProposer(folder, tiny_llama_folder, NgramProposer(2, 4))
    for phase in proposer.phases():
        phase()
    assert proposer.feature_width == 0 and proposer.vocab_size == 97 and proposer.num_phrase_tokens == 10
    sequences = [
        ProposeInput("phrases", [7, 41, 42, 43], 0, 2, GREEDY),  # "41 42 43" is a phrase of the target's
        ProposeInput("prompt", [51, 52, 53, 9, 51, 52], 0, 3, GREEDY),  # repeats itself: prompt lookup first
        ProposeInput("neither", [1, 2, 3, 4], 0, 3, GREEDY),
    ]
    assert [p.token_ids for p in proposer.propose(sequences)] == [[44, 45], [53, 9, 51], []]
    PhraseStore.from_sequences([[1, 2, 97]]).save(folder)  # an id past the tiny target's vocabulary of 97
    with pytest.raises(PhraseError, match="token id 97"):
        PhraseProposer(folder, tiny_llama_folder, NgramProposer(2, 4)).phases()[0]()
    other = _other_target(tiny_llama_folder, tmp_path)
    with pytest.raises(DraftMismatch, match="another target model"):
        PhraseProposer(folder, other, NgramProposer(2, 4))


def _ready(proposer: PhraseProposer) -> PhraseProposer:
    for phase in proposer.phases():
        phase()
    return proposer


def test_the_phrase_proposer_guesses_a_token_tree_of_its_likeliest_branches(
    tiny_llama_folder: Path,
    tiny_draft: tuple[EagleHead, Path],
    tmp_path: Path,
) -> None:
    folder = tmp_path / "draft"
    shutil.copytree(tiny_draft[1], folder)
    # After "1 2 3" the target wrote "4 5" twice and "6 7" once.
    PhraseStore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 4, 5]]).save(folder)
    proposer = _ready(PhraseProposer(folder, tiny_llama_folder, NgramProposer(2, 4)))
    context = [9, 1, 2, 3]
    (tree,) = proposer.propose([ProposeInput("t", context, 0, 4, GREEDY)])
    assert (tree.token_ids, tree.parents) == ([4, 5, 6, 7], [-1, 0, -1, 2])  # the likelier branch first
    (short,) = proposer.propose([ProposeInput("t", context, 0, 2, GREEDY)])
    assert (short.token_ids, short.parents) == ([4, 5], None)  # a chain goes as one
    # Chances: 4 0.38, then 5 0.27; 6 0.19, then 7 0.13. Proposed for with others, a guess must be likelier than
    # MIN_CHANCE times the sequences: 0.16 for 8 of them drops 7, 0.2 for 10 drops the branch.
    for num_seqs, expected in ((8, ([4, 5, 6], [-1, 0, -1])), (10, ([4, 5], None))):
        crowd = proposer.propose([ProposeInput(str(i), context, 0, 4, GREEDY) for i in range(num_seqs)])
        assert all((p.token_ids, p.parents) == expected for p in crowd), num_seqs
    sampled = SamplingParams(temperature=0.8, seed=1)
    assert proposer.propose([ProposeInput("t", context, 0, 4, sampled)]) == [tree]  # point masses for any request
    flat = _ready(PhraseProposer(folder, tiny_llama_folder, NgramProposer(2, 4), trees=False))
    for params in (GREEDY, sampled):
        (chain,) = flat.propose([ProposeInput("t", context, 0, 4, params)])
        assert (chain.token_ids, chain.parents) == ([4, 5], None)  # the majority's continuation, as before trees


def test_the_service_builds_each_distilled_kind_from_one_folder(
    tiny_llama_folder: Path,
    tiny_draft: tuple[EagleHead, Path],
    tmp_path: Path,
) -> None:
    from draft_service.config import add_arguments, from_arguments
    from common.defaults import HEAD_DRAFT_TOKENS
    from draft_service.service import make_proposer

    _, made = tiny_draft
    folder = tmp_path / "draft"
    shutil.copytree(made, folder)  # a head without phrases, as folders made before heads carried them

    def built(kind: str) -> Proposer:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        config = from_arguments(
            parser.parse_args(
                [
                    "--proposer",
                    f"{kind}:{folder}",
                    "--target-model",
                    str(tiny_llama_folder),
                    "--dtype",
                    "float32",
                    "--max-model-len",
                    "64",
                    "--num-seqs",
                    "2",
                    "--max-draft-tokens",
                    "4",
                    "--insecure-loopback",
                ]
            )
        )
        assert config.proposer.runs_model == (kind != "phrases")
        proposer = make_proposer(config)
        for phase in proposer.phases():
            phase()
        return proposer

    assert isinstance(built("eagle"), EagleProposer)
    assert isinstance(built("eagle+ngram"), LookupThenHead)  # needs no phrases
    for kind in ("phrases", "eagle+phrases"):
        with pytest.raises(FileNotFoundError, match="phrases.safetensors"):
            built(kind)
    PhraseStore.from_sequences([[40, 41, 42, 43, 44, 45]]).save(folder)
    phrases, hybrid = built("phrases"), built("eagle+phrases")
    assert isinstance(phrases, PhraseProposer) and phrases.feature_width == 0 and hybrid.feature_width == 64
    item = ProposeInput("r", [7, 41, 42, 43], 0, 4, GREEDY, torch.randn(3, 64))
    assert [p.token_ids for p in phrases.propose([item])] == [p.token_ids for p in hybrid.propose([item])] == [[44, 45]]
    # Only "43" matches: the phrases alone guess one token;
    # before the head only full matches count, so the head guesses.
    features = torch.randn(2, 64)
    (from_phrases,) = phrases.propose([ProposeInput("s", [7, 8, 43], 0, 4, GREEDY)])
    (from_hybrid,) = hybrid.propose([ProposeInput("s", [7, 8, 43], 0, 4, GREEDY, features)])
    (from_head,) = built("eagle").propose([ProposeInput("s", [7, 8, 43], 0, HEAD_DRAFT_TOKENS, GREEDY, features)])
    assert from_phrases.token_ids == [44]
    assert from_hybrid.token_ids == from_head.token_ids and len(from_head.token_ids) == HEAD_DRAFT_TOKENS
