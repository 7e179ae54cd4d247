"""The goodput policy: each step speculates as far as the measured step cost and acceptance say pays, and no further.

Pure logic first (best_drafts, the acceptance records), then the whole scheduler with a
fake target whose step time depends on the rows it computes, and a fake draft whose
proposals are right or wrong as the test says.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from proto import messages as m
from scheduler.speculation.acceptance import ANY, RequestAcceptance, ServerAcceptance, expected_accepted
from scheduler.speculation.policy import (
    EXPLORE_SHARE,
    PLAN_MARGIN,
    DraftOption,
    ExploreBudget,
    Unasked,
    best_drafts,
    beyond_reach,
    explored,
)
from tests.unit.scheduler_fakes import DEFAULT_TOKEN, FakeDraft, FakeWorker, Sim, prompt

SCRIPT = list(range(11, 11 + 200))


def option(key: str, rate: float, k: int, per_row_ms: float) -> DraftOption:
    return DraftOption.certain(key, expected_accepted([rate] * k), [per_row_ms * n for n in range(k + 1)])


# ---------------------------------------------------------------- the choice


def test_dear_rows_get_no_drafts_and_cheap_rows_get_every_draft() -> None:
    """A plain step of 4 sequences takes 10 ms. Rows that cost as much as a whole step never pay, even for drafts
    accepted 90% of the time; rows at 0.1 ms pay for all 6."""
    no_wait = lambda ks: 0.0  # noqa: E731
    dear = [option(f"r{i}", 0.9, 6, 10.0) for i in range(4)]
    assert best_drafts(dear, 4, 10.0, no_wait) == {}
    cheap = [option(f"r{i}", 0.9, 6, 0.1) for i in range(4)]
    assert best_drafts(cheap, 4, 10.0, no_wait) == {f"r{i}": 6 for i in range(4)}


def test_k_follows_acceptance_and_the_wait_for_proposals_can_make_plain_decoding_best() -> None:
    """With rows at 1 ms against a 10 ms step, a request whose drafts are accepted 90% of the time gets more of them
    than one at 50%, and one at 5% none; a wait of 30 ms for the proposal outweighs what any of them brings."""
    options = [option("good", 0.9, 6, 1.0), option("fair", 0.5, 6, 1.0), option("poor", 0.05, 6, 1.0)]
    ks = best_drafts(options, 3, 10.0, lambda ks: 2.0)
    assert "poor" not in ks and ks["good"] > ks.get("fair", 0) >= 1
    assert best_drafts(options, 3, 10.0, lambda ks: 30.0) == {}


def test_the_shortcut_past_the_choice_never_skips_a_step_that_would_speculate() -> None:
    """`beyond_reach` says a step cannot pay only where `best_drafts` finds nothing either, over random outlooks (a
    request's drafts found or not, from two sources, chains at rates 0-1), row prices and waits; and it does say so for
    most of the steps where nothing pays."""
    rng = random.Random(7)
    skipped = empty = 0
    for _ in range(3000):
        num_seqs = rng.randint(1, 4)
        base_ms, row_ms = rng.uniform(3.0, 15.0), rng.uniform(0.05, 3.0)
        fixed_wait, wait_per_token = rng.uniform(0.0, 2.0), rng.uniform(0.0, 0.3)
        outlooks = {}
        for i in range(num_seqs):
            found = rng.random()
            share = rng.random()
            k = rng.randint(1, 6)
            outlooks[f"r{i}"] = [
                (found * share, expected_accepted([rng.random() ** 2 for _ in range(k)])),
                (found * (1 - share), expected_accepted([rng.random() ** 3 for _ in range(k)])),
            ]
        options = [
            DraftOption(key, [row_ms * n + 0.01 * n * n for n in range(len(outlook[0][1]))], outlook)
            for key, outlook in outlooks.items()
        ]
        wait = lambda ks: fixed_wait + wait_per_token * max(ks.values())  # noqa: E731
        chosen = best_drafts(options, num_seqs, base_ms, wait, PLAN_MARGIN)
        empty += not chosen
        if beyond_reach(outlooks.values(), num_seqs / base_ms * (1 + PLAN_MARGIN), row_ms, wait({"": 1})):
            assert chosen == {}
            skipped += 1
    assert skipped > empty / 2


def test_the_answer_maximises_tokens_per_ms_over_every_choice() -> None:
    """Against brute force over every combination of k for three sequences."""
    options = [option("a", 0.8, 4, 1.5), option("b", 0.6, 4, 0.7), option("c", 0.3, 4, 2.0)]
    wait = lambda ks: 1.0 + 0.2 * max(ks.values())  # noqa: E731

    def rate(ks: dict[str, int]) -> float:
        tokens = 3 + sum(o.outcomes[0][1][ks.get(o.key, 0)] for o in options)
        ms = 12.0 + sum(o.extra_ms[ks.get(o.key, 0)] for o in options) + (wait(ks) if ks else 0.0)
        return tokens / ms

    best = max(
        (
            {k: v for k, v in zip("abc", combo) if v}
            for combo in [(x, y, z) for x in range(5) for y in range(5) for z in range(5)]
        ),
        key=rate,
    )
    assert rate(best_drafts(options, 3, 12.0, wait)) == pytest.approx(rate(best), rel=0.01)


def test_a_chain_brings_the_product_of_its_rates_and_a_tree_the_sum_of_its_nodes_chances() -> None:
    assert expected_accepted([0.5, 0.5]) == [0.0, 0.5, 0.75]
    server = ServerAcceptance()
    for branch in ([0], [1], [0, 2], []):  # trees of 3 nodes: two guesses at depth 1, a third under the first
        server.observe("phrases", 2, 3, len(branch))
        server.observe_tree("phrases", 3, branch)
    chances = server.node_chances("phrases", 4)
    # (accepted + prior) / (trees + 1), the prior the first depth's rate (1/2 here) halved at each node; later trees
    # weigh a little more.
    assert chances[:3] == pytest.approx([(2 + 0.5) / 5, (1 + 0.25) / 5, (1 + 0.125) / 5], rel=0.1)
    assert chances[3] < chances[0]  # a node no tree had: less likely than the first
    gains = RequestAcceptance().tree_gains("phrases", 3, server)
    assert gains[0] == 0 and gains[1] < gains[2] < gains[3]  # the second guess at depth 1 adds its own chance


# ---------------------------------------------------------------- the records


def test_a_chain_is_read_at_its_means() -> None:
    """Four verify steps of 6 lookup drafts, 1 to 4 accepted. Read optimistically (the mean plus half a standard error)
    at each position, the rates multiply down the chain and promise more than the means: with rows at 1.5 ms against a
    4 ms step, they would verify 3 drafts where the means pay for 2."""
    server, request = ServerAcceptance(), RequestAcceptance()
    for accepted in (2, 4, 1, 3):
        server.observe("lookup", 6, 6, accepted)
        request.observe("lookup", 6, accepted)
    own = request.by_source["lookup"]
    means = [own.mean(position, server.rate("lookup", position), 1.0) for position in range(6)]
    rates = request.rates("lookup", 6, server)
    assert rates == means

    def chosen(chain: list[float]) -> dict[str, int]:
        return best_drafts(
            [DraftOption.certain("a", expected_accepted(chain), [1.5 * n for n in range(7)])], 1, 4.0, lambda ks: 0.0
        )

    def optimistic(mean: float, weight: float) -> float:
        return min(1.0, mean + 0.5 * math.sqrt(max(mean * (1 - mean), 1 / (weight + 2)) / (weight + 1)))

    assert chosen(rates) == {"a": 2}
    assert chosen([optimistic(mean, own.weight(position)) for position, mean in enumerate(means)]) == {"a": 3}


def test_requests_the_estimates_do_not_ask_for_are_tried_new_ones_first_then_by_turns_within_the_budget() -> None:
    """Rows at 0.5 ms, a wait of 1 ms. A request never asked is tried first, while the budget holds its row and (the
    step asking nothing else) the wait; then the one longest unasked, while the budget would still hold a new
    request's ask after it."""
    budget = ExploreBudget()
    budget.balance_ms = 2.0
    new = [Unasked("b", 3, 0.5), Unasked("a", math.inf, 0.5), Unasked("c", math.inf, 0.5)]
    assert explored(new, 1.0, budget, asking=False) == ["a", "c"]  # 1.5 ms, then c's row: b would leave no reserve
    assert budget.balance_ms == pytest.approx(0.0)
    budget.balance_ms = 1.4
    assert explored(new, 1.0, budget, asking=False) == []
    older = [Unasked("b", 3, 0.5), Unasked("d", 9, 0.5), Unasked("e", 0, 0.5)]
    budget.balance_ms = 2.9
    assert explored(older, 1.0, budget, asking=False) == []  # d's ask and a new request's after it: 3 ms
    budget.balance_ms = 3.1
    assert explored(older, 1.0, budget, asking=False) == ["d"]
    assert budget.balance_ms == pytest.approx(1.6)
    budget.balance_ms = 2.5
    assert explored(older, 1.0, budget, asking=True) == ["d", "b"]  # the step waits anyway: rows only
    budget.balance_ms = 10.0
    assert explored(older, 1.0, budget, asking=True) == ["d", "b"]  # e was asked for in its last step
    budget = ExploreBudget()
    full = budget.balance_ms
    budget.balance_ms = 0.0
    budget.earn(100.0)
    assert budget.balance_ms == pytest.approx(100.0 * EXPLORE_SHARE)
    for _ in range(1000):
        budget.earn(100.0)
    assert budget.balance_ms == pytest.approx(full)


def test_where_drafts_never_pay_trying_them_costs_the_explore_share_of_the_time() -> None:
    """Rows at 3 ms against a 10 ms step, a wait of 2 ms, every draft rejected: after the first tries, the asks and the
    rows they verify take about EXPLORE_SHARE of the target's time."""
    sim, worker, draft = setup(3.0)
    script = list(range(11, 11 + 500))
    sim.submit("a", prompt(3), max_tokens=500)
    start_s = sim.now_s
    asks = rows = 0
    while True:
        done = len(worker.returned.get("a", []))
        if (asked := draft.pending_propose()) is not None:
            asks += 1
            sim.advance(0.002)
            draft.answer({"a": [t + 1000 for t in script[done : done + asked.seqs[0].num_tokens]]})
        step = worker.pending_step()
        if step is None:
            break
        rows += sum(seq.num_draft_tokens for seq in step.seqs)
        sim.advance(worker.step_ms(step) / 1000)
        worker.complete({"a": script[done : done + 5]})
    spent_ms = 2.0 * asks + 3.0 * rows
    total_ms = (sim.now_s - start_s) * 1000
    assert sim.streamed("a") == script
    assert asks >= 5, "it is tried again now and then"
    # What the budget starts with, then its share of the time (a little more: the wait it pays is the one predicted).
    assert spent_ms <= EXPLORE_SHARE * (1000.0 + 1.2 * total_ms), (asks, rows, total_ms)
    assert asks * 1000.0 > total_ms, "and no less than that share buys"


def test_a_request_starts_from_its_sources_server_rate_and_then_follows_its_own_drafts() -> None:
    server = ServerAcceptance()
    for _ in range(100):
        server.observe("lookup", 4, 4, 4)  # lookup: everything accepted
        server.observe("phrases", 4, 4, 0)  # phrases: nothing
    request = RequestAcceptance()
    assert request.rates("lookup", 2, server)[0] > 0.95
    assert request.rates("phrases", 2, server)[0] < 0.5
    for _ in range(10):
        request.observe("lookup", 4, 0)  # this request's lookups are all wrong
    assert request.rates("lookup", 1, server)[0] < 0.3
    for _ in range(120):
        request.plain_step()  # steps that offered it nothing leave its record as it was: only a try changes it
    assert request.rates("lookup", 1, server)[0] < 0.3


def test_a_source_not_seen_yet_is_not_judged_by_the_others_record() -> None:
    """Prompt lookup may first answer long after the phrases did (an edit starts copying its passage a few sentences
    in): judged by the phrases' poor record its first proposals would be cut away unverified, and it would never be
    learned. A source without a record of its own is rated 1/2, as uncertain as a rate can be."""
    server = ServerAcceptance()
    for _ in range(100):
        server.observe("phrases", 4, 4, 0)  # the phrases: nothing accepted
    assert server.rate("phrases", 0) < 0.05
    assert server.rate("lookup", 0) == 0.5
    request = RequestAcceptance()
    assert request.rates("lookup", 1, server)[0] == 0.5
    assert request.rates("phrases", 1, server)[0] < 0.5


def test_positions_are_rated_given_the_ones_before_them_and_unknown_sources_are_counted_as_other() -> None:
    server = ServerAcceptance()
    for accepted in (0, 1, 2, 3):  # each position reached by fewer steps
        server.observe("lookup", 3, 3, accepted)
    rates = server.rates("lookup", 3)
    # Position 0: 3 of 4 accepted; position 1: 2 of the 3 that reached it; position 2: 1 of 2 (each with a 1/2 prior).
    assert rates == pytest.approx([(3 + 0.5) / 5, (2 + 0.5) / 4, (1 + 0.5) / 3], rel=0.01)  # little forgotten yet
    server.observe("anything a draft says", 1, 1, 1)
    assert "other" in server.by_source and "anything a draft says" not in server.by_source
    info = server.info(m.MAX_DRAFT_TOKENS)
    assert info["lookup"].num_verify_steps == 4 and info["lookup"].num_accepted_draft_tokens == 6
    assert ANY not in info


# ---------------------------------------------------------------- the scheduler


def setup(per_row_ms: float, **config: object) -> tuple[Sim, FakeWorker, FakeDraft]:
    """A target whose step takes 10 ms plus per_row_ms for each row after a sequence's first (and says so of its
    warm-up steps, as the real one does), and a draft."""
    sim = Sim(speculation_policy="goodput", num_speculative_tokens=4, max_model_len=512, **config)
    worker = sim.worker("w0", max_draft_tokens=8)
    worker.step_ms = lambda step: 10.0 + per_row_ms * sum(len(seq.token_ids) - 1 for seq in step.seqs)
    worker.warm_up_timings = [m.StepTiming(rows, 0, rows * 10, 10.0 + per_row_ms * (rows - 1)) for rows in (1, 5, 3, 1)]
    worker.start()
    draft = sim.draft("d0").start()
    return sim, worker, draft


def run(worker: FakeWorker, draft: FakeDraft, num_steps: int, right: Callable[[int], bool]) -> list[int]:
    """Drive `num_steps` steps of request "a" (the target follows SCRIPT);
    the draft's proposal in step i is the script's
    continuation where right(i), else wrong tokens. Returns the draft tokens each step verified."""
    drafts = []
    for index in range(num_steps):
        done = len(worker.returned.get("a", []))  # the gateway gets them once the next step is sent
        if (asked := draft.pending_propose()) is not None:
            k = asked.seqs[0].num_tokens
            draft.answer(
                {"a": SCRIPT[done : done + k] if right(index) else [t + 1000 for t in SCRIPT[done : done + k]]}
            )
        step = worker.pending_step()
        if step is None:
            break
        drafts.append(sum(seq.num_draft_tokens for seq in step.seqs if seq.request_id == "a"))
        worker.complete({"a": SCRIPT[done : done + 5]})
    return drafts


@pytest.mark.parametrize("per_row_ms", [100.0, 0.05])
def test_a_worker_whose_rows_are_dear_gets_no_drafts_and_a_cheap_one_gets_full_k(per_row_ms: float) -> None:
    """The same draft, right every other step: rows at 100 ms against a 10 ms step never pay for it once the first
    tries have shown what it is worth; rows at 0.05 ms pay for all 4 draft tokens."""
    sim, worker, draft = setup(per_row_ms)
    sim.submit("a", prompt(3), max_tokens=150)
    drafts = run(worker, draft, 40, lambda index: index % 2 == 0)
    if per_row_ms > 1:
        assert sum(drafts[25:]) == 0, drafts  # a first try, once the explore budget holds it, then none
    else:
        assert drafts[-10:] == [4] * 10, drafts
        assert sim.info().speculation is not None and sim.info().speculation.steps_by_k.get(4, 0) >= 10
    assert sim.streamed("a") == SCRIPT[: len(sim.streamed("a"))]


def test_a_request_whose_drafts_are_rejected_stops_being_offered_them_then_recovers_when_they_are_accepted() -> None:
    """Rows at 3 ms against a 10 ms step: a draft pays only where it is accepted a fair share of the time."""
    sim, worker, draft = setup(3.0)
    sim.submit("a", prompt(3), max_tokens=190)
    wrong = run(worker, draft, 60, lambda index: False)
    assert sum(1 for d in wrong[:5] if d) >= 1, "a new request is tried"
    late = wrong[20:]
    assert sum(1 for d in late if d) <= len(late) // 4, f"rejected drafts were still offered: {wrong}"
    right = run(worker, draft, 100, lambda index: True)
    assert sum(1 for d in right[-20:] if d) >= 18, f"accepted drafts were not offered again: {right}"
    assert sim.streamed("a") == SCRIPT[: len(sim.streamed("a"))]


def test_a_request_the_draft_finds_nothing_for_stops_being_asked_so_its_steps_do_not_wait() -> None:
    """Prompt lookup on free chat: most steps it matches nothing, and the step waited for that answer in vain."""
    sim, worker, draft = setup(0.5)
    worker.sim.advance(0.0)
    sim.submit("a", prompt(3), max_tokens=120)
    asked = []
    for _ in range(80):
        done = len(worker.returned.get("a", []))
        if draft.pending_propose() is not None:
            asked.append(done)
            sim.advance(0.004)  # the wait: 4 ms against a 10 ms step
            draft.answer({"a": []})
        step = worker.pending_step()
        if step is None:
            break
        worker.complete({"a": SCRIPT[done : done + 5]})
    assert asked and asked[0] < 5, "a new request's draft is asked"
    late = [done for done in asked if done >= 40]
    assert len(late) <= 8, f"asked at {asked}"  # retried now and then, not every step


def test_the_draft_is_asked_where_one_of_the_sources_that_may_answer_pays_even_if_their_average_would_not() -> None:
    """Rows at 0.9 ms against a 4.4 ms step, 1.2 ms to wait for the answer: prompt lookup (answering a quarter of the
    time, 90% accepted) pays for all 6 rows, the phrases (the rest, 5% accepted) for none. Each answer is cut to what
    pays when it comes, so the draft is worth asking; one chain of their average would say no."""
    extra = [0.9 * n for n in range(7)]
    mixed = DraftOption("a", extra, [(0.25, expected_accepted([0.9] * 6)), (0.75, expected_accepted([0.05] * 6))])
    assert best_drafts([mixed], 1, 4.4, lambda ks: 1.2) == {"a": 6}
    average = DraftOption.certain(
        "a", [0.25 * a + 0.75 * b for a, b in zip(expected_accepted([0.9] * 6), expected_accepted([0.05] * 6))], extra
    )
    assert best_drafts([average], 1, 4.4, lambda ks: 1.2) == {}


def test_a_new_request_is_asked_at_once_after_a_run_of_requests_the_draft_found_nothing_for() -> None:
    """Chat, then editing: the server's record says prompt lookup finds nothing, but a request not asked yet is asked,
    and one whose draft finds its continuation goes on being asked."""
    sim, worker, draft = setup(0.5)
    sim.submit("chat", prompt(3), max_tokens=60)
    chat_asks = []
    for _ in range(70):
        done = len(worker.returned.get("chat", []))
        if draft.pending_propose() is not None:
            chat_asks.append(done)
            sim.advance(0.004)
            draft.answer({"chat": []})
        if worker.pending_step() is None:
            break
        worker.complete({"chat": [DEFAULT_TOKEN]})
    assert len([done for done in chat_asks if done >= 20]) <= 4, f"asked at {chat_asks}"
    sim.submit("edit", prompt(3, first=300), max_tokens=120)
    worker.complete({"edit": [11]})  # its prefill
    edit = list(SCRIPT) * 10
    drafts = []
    for _ in range(40):
        done = len(worker.returned["edit"])
        if (asked := draft.pending_propose()) is not None:
            sim.advance(0.004)
            draft.answer({"edit": edit[done : done + asked.seqs[0].num_tokens]})
        step = worker.pending_step()
        if step is None:
            break
        drafts.append(step.seqs[0].num_draft_tokens)
        worker.complete({"edit": edit[done : done + 5]})
    assert drafts[0] > 0, "a request not asked yet is asked"
    assert sum(1 for d in drafts if d) >= 0.8 * len(drafts), drafts


def test_a_step_asks_for_proposals_only_for_a_gain_beyond_its_estimates_error() -> None:
    """A 10 ms step of one token, 1 ms to wait: drafts expected to bring 0.13 tokens more (1.8% faster) are not asked
    for at the plan's margin, 0.5 tokens more (35%) are; with no margin both are."""

    def option(gain: float) -> DraftOption:
        return DraftOption.certain("a", [0.0, gain], [0.0, 0.1])

    assert best_drafts([option(0.13)], 1, 10.0, lambda ks: 1.0, PLAN_MARGIN) == {}
    assert best_drafts([option(0.13)], 1, 10.0, lambda ks: 1.0) == {"a": 1}
    assert best_drafts([option(0.5)], 1, 10.0, lambda ks: 1.0, PLAN_MARGIN) == {"a": 1}


def run_said(worker: FakeWorker, draft: FakeDraft, num_steps: int, chances: list[float], num_right: int) -> list[int]:
    """Drive `num_steps` steps of request "a", the draft answering with the script's first `num_right` tokens then
    wrong ones, each given its chance by the draft as `chances` says. Returns the draft tokens each step verified."""
    drafts = []
    for _ in range(num_steps):
        done = len(worker.returned.get("a", []))
        if (asked := draft.pending_propose()) is not None:
            k = asked.seqs[0].num_tokens
            tokens = [t if n < num_right else t + 1000 for n, t in enumerate(SCRIPT[done : done + k])]
            draft.answer({"a": tokens}, chances={"a": chances})
        step = worker.pending_step()
        if step is None:
            break
        drafts.append(sum(seq.num_draft_tokens for seq in step.seqs if seq.request_id == "a"))
        worker.complete({"a": SCRIPT[done : done + 5]})
    return drafts


@pytest.mark.parametrize(("chances", "depth"), [([1.0, 1.0, 1.0, 1.0], 4), ([1.0, 1.0, 0.1, 0.1], 2)])
def test_a_proposal_whose_drafts_carry_their_chances_is_verified_as_deep_as_they_pay(
    chances: list[float], depth: int
) -> None:
    """Rows at 3 ms against a 10 ms step: the draft says how sure it is of each token (as the suffix store does), and
    that decides how many are verified, the first proposal included; a draft it doubts is left out even when right."""
    sim, worker, draft = setup(3.0)
    sim.submit("a", prompt(3), max_tokens=150)
    drafts = run_said(worker, draft, 30, chances, num_right=4)
    verified = [d for d in drafts if d]
    assert verified and verified[0] == depth and verified[-5:] == [depth] * 5, drafts
    assert sim.streamed("a") == SCRIPT[: len(sim.streamed("a"))]


def test_a_drafts_chances_that_overstate_are_held_to_what_the_target_accepted() -> None:
    """The draft says 0.9 for each of 4 tokens, but only the first is ever right: the source's and the request's
    records bring its chances down to what is accepted, and the verified drafts shrink from the first step's 4."""
    sim, worker, draft = setup(3.0)
    sim.submit("a", prompt(3), max_tokens=150)
    drafts = run_said(worker, draft, 40, [0.9] * 4, num_right=1)
    assert drafts[[d > 0 for d in drafts].index(True)] == 4, drafts
    assert max(drafts[-10:]) <= 1, drafts
    record = sim.info().speculation
    assert record is not None and record.sources["suffix"].num_accepted_draft_tokens < record.num_draft_tokens
    assert sim.streamed("a") == SCRIPT[: len(sim.streamed("a"))]


def test_a_lookup_draft_is_asked_for_its_whole_cap_and_its_chances_decide_what_is_verified() -> None:
    """A lookup costs the draft no more for 4 tokens than for 2, and its later drafts' chances are only known once it
    is asked that far: it is asked for the cap (4) in each step, and 2 of them (the ones it is sure of) are verified."""
    sim, worker, draft = setup(3.0)
    sim.submit("a", prompt(3), max_tokens=150)
    asked: list[int] = []
    drafts = []
    for _ in range(30):
        done = len(worker.returned.get("a", []))
        if (request := draft.pending_propose()) is not None:
            asked.append(request.seqs[0].num_tokens)
            draft.answer({"a": SCRIPT[done : done + request.seqs[0].num_tokens]}, chances={"a": [1.0, 1.0, 0.1, 0.1]})
        step = worker.pending_step()
        if step is None:
            break
        drafts.append(step.seqs[0].num_draft_tokens)
        worker.complete({"a": SCRIPT[done : done + 5]})
    assert asked and set(asked) == {4}, asked
    assert [d for d in drafts if d][-5:] == [2] * 5, drafts
