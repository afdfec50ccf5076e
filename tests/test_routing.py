"""Prefix-hash routing: rendezvous ranking (common/routing.py), the bounded-load fallback (its Python
reference, tests/routing_reference.py, which the placement script matches: tests/test_dispatch.py), first-K keys."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from api.preparation import JobPreparer
from common.contract import SystemOneRequest
from common.prompt import PromptCompiler
from common.routing import prefix_key, rank_workers
from common.settings import Settings
from tests.routing_reference import load_bound, round_robin, route_job

WORKERS = [f"gpu-{i}" for i in range(8)]
KEYS = [prefix_key([i, i * 7 + 1, 42]) for i in range(10_000)]
HOT = prefix_key([1, 2, 3])


def placed(key: str, lengths_by_rank: list[int], load_factor: float = 1.25) -> int:
    """Where `route_job` sends `key` when the workers of its ranking hold `lengths_by_rank` jobs
    (best first): the position in the ranking."""
    ranking = rank_workers(key, WORKERS[: len(lengths_by_rank)])
    chosen = route_job(key, dict(zip(ranking, lengths_by_rank, strict=True)), load_factor)
    return ranking.index(chosen)


def test_ranking_is_the_same_whatever_order_the_workers_are_listed_in() -> None:
    rng = random.Random(7)
    for key in KEYS[:500]:
        shuffled = rng.sample(WORKERS, len(WORKERS))
        assert rank_workers(key, shuffled) == rank_workers(key, WORKERS)
    assert sorted(rank_workers(HOT, WORKERS)) == sorted(WORKERS)


def test_keys_spread_evenly_over_the_workers() -> None:
    counts = Counter(rank_workers(key, WORKERS)[0] for key in KEYS)
    mean = len(KEYS) / len(WORKERS)
    assert set(counts) == set(WORKERS)
    assert max(counts.values()) / mean <= 1.1
    assert min(counts.values()) / mean >= 0.9


def test_only_the_leaving_workers_keys_move_when_one_of_n_leaves() -> None:
    n = len(WORKERS)
    leaving = WORKERS[3]
    before = {key: rank_workers(key, WORKERS) for key in KEYS}
    after = {key: rank_workers(key, [w for w in WORKERS if w != leaving])[0] for key in KEYS}
    moved = [key for key in KEYS if after[key] != before[key][0]]
    assert 0.8 / n <= len(moved) / len(KEYS) <= 1.2 / n
    assert all(before[key][0] == leaving for key in moved)
    assert all(after[key] == before[key][1] for key in moved)  # each goes to its own second choice


def test_a_joining_worker_takes_about_one_in_n_plus_one_keys_and_only_for_itself() -> None:
    joined = [*WORKERS, "gpu-new"]
    before = {key: rank_workers(key, WORKERS)[0] for key in KEYS}
    after = {key: rank_workers(key, joined)[0] for key in KEYS}
    moved = [key for key in KEYS if after[key] != before[key]]
    n = len(joined)
    assert 0.8 / n <= len(moved) / len(KEYS) <= 1.2 / n
    assert {after[key] for key in moved} == {"gpu-new"}


@pytest.mark.parametrize(("lengths", "load_factor", "bound"), [
    ({"a": 0, "b": 0, "c": 0, "d": 0}, 1.25, 1),  # ⌈1.25 · 1/4⌉
    ({"a": 4, "b": 4, "c": 4, "d": 3}, 1.25, 5),  # ⌈1.25 · 16/4⌉ = 5 exactly
    ({"a": 4, "b": 4, "c": 4, "d": 4}, 1.25, 6),  # ⌈1.25 · 17/4⌉ = ⌈5.3125⌉
    ({"a": 1, "b": 1, "c": 1, "d": 1}, 1.25, 2),  # ⌈1.5625⌉
    ({"a": 2, "b": 0, "c": 0, "d": 0}, 1.25, 1),  # ⌈0.9375⌉
    ({"a": 9, "b": 1}, 1.0, 6),  # c = 1: the plain average counting the new job, ⌈11/2⌉
    ({"a": 9, "b": 1}, 2.0, 11),
])
def test_load_bound_is_c_times_the_average_counting_the_new_job_rounded_up(
        lengths: dict[str, int], load_factor: float, bound: int) -> None:
    assert load_bound(lengths, load_factor) == bound


@pytest.mark.parametrize(("lengths_by_rank", "position"), [
    ([4, 4, 4, 3], 0),  # 4 + 1 = 5 = bound 5: still within, the first choice keeps it
    ([5, 4, 3, 3], 1),  # 5 + 1 = 6 > bound 5: one job over, the second choice takes it
    ([5, 5, 3, 2], 2),  # both ahead over the bound: the walk goes on down the ranking
    ([1, 1, 1, 1], 0),  # light even load: 2 ≤ bound 2
    ([3, 2, 2, 2], 0),  # 4 ≤ ⌈1.25 · 10/4⌉ = 4: counted in whole jobs, 3 > 1.25 · 2.25 does not move it
    ([1, 0, 0, 0], 1),  # one busy, three idle: 2 > bound ⌈1.25 · 2/4⌉ = 1
    ([0, 0, 0, 0], 0),
    ([0, 1, 1, 1], 0),
])
def test_the_next_worker_in_the_ranking_is_taken_exactly_when_the_bound_is_crossed(
        lengths_by_rank: list[int], position: int) -> None:
    assert placed(HOT, lengths_by_rank) == position


def test_a_higher_load_factor_keeps_the_first_choice_longer() -> None:
    assert placed(HOT, [5, 4, 3, 3], load_factor=1.25) == 1
    assert placed(HOT, [5, 4, 3, 3], load_factor=1.5) == 0  # bound ⌈1.5 · 16/4⌉ = 6


def test_a_hot_prefix_fills_its_ranking_in_order_and_no_queue_exceeds_the_bound() -> None:
    workers = WORKERS[:4]
    ranking = rank_workers(HOT, workers)
    lengths = dict.fromkeys(workers, 0)
    for _ in range(40):
        chosen = route_job(HOT, lengths)
        assert lengths[chosen] + 1 <= load_bound(lengths, 1.25)
        lengths[chosen] += 1
    assert [lengths[w] for w in ranking] == [13, 13, 12, 2]  # ⌈1.25 · 40/4⌉ = 13 each, in ranking order


def test_route_job_refuses_no_workers_and_a_load_factor_below_one() -> None:
    with pytest.raises(LookupError):
        route_job(HOT, {})
    with pytest.raises(ValueError):
        route_job(HOT, {"a": 0}, load_factor=0.9)


def test_round_robin_takes_each_worker_in_turn_whatever_their_order() -> None:
    turns = [round_robin(turn, ["c", "a", "b"]) for turn in range(1, 7)]
    assert turns == ["b", "c", "a", "b", "c", "a"]
    assert round_robin(5, ["b", "a", "c"]) == round_robin(5, ["c", "b", "a"])


SYSTEM_TOKENS = list(range(1000, 1600))  # a 600-token system prompt every state starts with


def test_first_k_prefix_key_groups_states_that_share_a_long_system_prompt() -> None:
    states = [[*SYSTEM_TOKENS, 7, i, i + 1, 9] for i in range(50)]
    grouped = {prefix_key(ids, first_k=512) for ids in states}
    whole = {prefix_key(ids) for ids in states}
    past_the_shared_part = {prefix_key(ids, first_k=603) for ids in states}
    assert len(grouped) == 1
    assert len(whole) == len(past_the_shared_part) == len(states)
    idle = dict.fromkeys(WORKERS, 0)
    assert len({route_job(key, idle) for key in grouped}) == 1
    assert len({route_job(key, idle) for key in whole}) > 1


def test_prefix_key_is_the_hash_of_the_whole_prefix_when_k_exceeds_it() -> None:
    assert prefix_key([5, 6, 7], first_k=100) == prefix_key([5, 6, 7])
    assert prefix_key([5, 6, 7], first_k=2) == prefix_key([5, 6])
    assert prefix_key([5, 6, 7]) != prefix_key([5, 6, 8])


def support_request(ticket: str) -> SystemOneRequest:
    system = "You triage support tickets for Acme Cloud. " + " ".join(
        f"Rule {i}: route billing disputes, refunds and invoices to Billing, outages to Technical." for i in range(12))
    return SystemOneRequest.model_validate({
        "model": "jev-latest",
        "state": [{"role": "system", "content": system}, {"role": "user", "content": ticket}],
        "questions": {"refund": {"type": "noul", "instructions": "Is a refund asked for?"}},
    })


def test_the_api_hashes_the_configured_first_k_prefix_tokens(smollm2_compiler: PromptCompiler) -> None:
    tickets = ["I was charged twice in March.", "The dashboard is down since noon.", "Can I upgrade my plan?"]
    whole = JobPreparer(Settings(), smollm2_compiler)
    first_k = JobPreparer(Settings(route_prefix_tokens=128), smollm2_compiler)
    jobs = [first_k.prepare(support_request(t), "req_test", 60) for t in tickets]
    assert all(len(job.prefix_ids) > 200 for job in jobs)  # the system prompt alone is longer than K
    assert {job.prefix_hash for job in jobs} == {prefix_key(jobs[0].prefix_ids[:128])}
    assert len({whole.prepare(support_request(t), "req_test", 60).prefix_hash for t in tickets}) == len(tickets)


def test_prefix_key_hashes_the_ids_as_little_endian_uint32_so_routing_survives_an_upgrade() -> None:
    ids = [0, 1, 255, 256, 151_642, 2**32 - 1, *range(1000, 9000)]
    h = hashlib.blake2b(digest_size=16)
    for token in ids:
        h.update(token.to_bytes(4, "little", signed=False))
    assert prefix_key(ids) == h.hexdigest()
    assert prefix_key(ids, first_k=3) == hashlib.blake2b(bytes([0, 0, 0, 0, 1, 0, 0, 0, 255, 0, 0, 0]),
                                                         digest_size=16).hexdigest()
