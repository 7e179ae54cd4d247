"""Drafting from served text (draft_service/traffic.py, suffix_proposer.py): scoped by tenant, merged with prompt
lookup into one tree, and held to what the target accepted."""

from __future__ import annotations

from proto.messages import SamplingParams
from draft_service.prompt_lookup import NgramProposer
from draft_service.proposer import ProposeInput
from draft_service.suffix_proposer import SuffixProposer
from draft_service.traffic import TrafficDrafts, _Calibration

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57]  # what followed "1 2 3 4" in a served text


def _proposer(scope: str = "tenant") -> SuffixProposer:
    return SuffixProposer(TrafficDrafts(10_000, 1000, scope), NgramProposer(2, 4))  # type: ignore[arg-type]


def _ask(proposer: SuffixProposer, tenant: str, tokens: list[int], k: int = 6, request_id: str = "r") -> list[int]:
    item = ProposeInput(request_id, tokens, 0, k, SamplingParams(), tenant=tenant)
    return proposer.propose([item])[0].token_ids


def test_a_tenants_served_text_drafts_for_its_own_requests_only() -> None:
    proposer = _proposer()
    proposer.traffic.record("a", [9, 9, 1, 2, 3, 4, *ANSWER])
    asked = [7, 8, 1, 2, 3, 4]
    assert _ask(proposer, "a", asked)[:3] == ANSWER[:3]
    assert _ask(proposer, "b", asked) == [] and _ask(proposer, "", asked) == []
    shared = _proposer("global")
    shared.traffic.record("a", [9, 9, 1, 2, 3, 4, *ANSWER])
    assert _ask(shared, "b", asked)[:3] == ANSWER[:3]
    alone = _proposer("request")
    alone.traffic.record("a", [9, 9, 1, 2, 3, 4, *ANSWER])
    assert not alone.traffic.keeps_text and _ask(alone, "a", asked) == []


def test_the_requests_own_text_comes_first_and_both_share_one_tree() -> None:
    proposer = _proposer()
    proposer.traffic.record("a", [1, 2, 3, 4, 60, 61, 62])
    own = [1, 2, 3, 4, 70, 71, 72, 5, 1, 2, 3, 4]  # prompt lookup finds 70 71 72 after "1 2 3 4"
    item = ProposeInput("r", own, 0, 6, SamplingParams(), tenant="a")
    made = proposer.propose([item])[0]
    assert made.source == "lookup" and made.token_ids[:3] == [70, 71, 72]
    assert 60 in made.token_ids and made.parents is not None  # the store's guess is a branch beside it


def test_drafts_the_target_rejects_are_trusted_less_and_accepted_ones_more() -> None:
    proposer = _proposer()
    proposer.traffic.record("a", [1, 2, 3, 4, 60, 61, 62, 63])
    scale = proposer.traffic._calibrations  # by tenant, once drafted for

    def round_trip(next_token: int, request_id: str) -> None:
        context = [8, 1, 2, 3, 4]
        _ask(proposer, "a", context, request_id=request_id)
        _ask(proposer, "a", [*context, next_token], request_id=request_id)  # the target wrote next_token

    round_trip(60, "r0")
    first = scale["a"].scale
    for index in range(20):
        round_trip(99, f"no{index}")  # the target never writes what the store offers
    assert scale["a"].scale < first
    low = scale["a"].scale
    for index in range(20):
        round_trip(60, f"yes{index}")
    assert scale["a"].scale > low


def test_each_draft_carries_its_chance_no_node_likelier_than_its_parent_nor_than_certain() -> None:
    proposer = _proposer()
    proposer.traffic.record("a", [9, 9, 1, 2, 3, 4, *ANSWER])
    proposer.traffic.record("a", [8, 8, 1, 2, 3, 4, 50, 51, 70, 71])  # a second continuation: a branch at 52 / 70
    proposer.traffic._calibrations["a"] = _Calibration(predicted=0.5, observed=1.0)  # scaled twice up: capped at 1
    made = proposer.propose([ProposeInput("r", [7, 1, 2, 3, 4], 0, 6, SamplingParams(), tenant="a")])[0]
    assert made.chances is not None and len(made.chances) == len(made.token_ids) == 6
    assert all(0.0 <= chance <= 1.0 for chance in made.chances)
    parents = made.parents if made.parents is not None else list(range(-1, 5))
    assert all(made.chances[node] <= made.chances[parent] for node, parent in enumerate(parents) if parent >= 0)


def test_what_the_target_wrote_after_every_draft_position_calibrates_the_store_verified_or_not() -> None:
    """The store's trust for a 3-token match starts near 0.5 a token; a tenant whose sequences go on to write its whole
    branch every time (none of it verified: the sequence just moves on) sees its deep drafts' chances rise."""
    proposer = _proposer()
    proposer.traffic.record("a", [9, 9, 1, 2, 3, 4, *ANSWER])

    def deepest(request_id: str) -> float:
        made = proposer.propose([ProposeInput(request_id, [7, 1, 2, 3, 4], 0, 6, SamplingParams(), tenant="a")])[0]
        assert made.chances is not None and made.token_ids == ANSWER[:6]
        return made.chances[-1]

    first = deepest("r0")
    for index in range(30):
        deepest(f"r{index}")
        _ask(proposer, "a", [7, 1, 2, 3, 4, *ANSWER], request_id=f"r{index}")  # the target wrote the whole branch
    assert deepest("last") > 5 * first  # each token scaled, not the branch once
