"""The partition against a brute force over every split, and against the paper's closed forms (§4.1.2)."""

import math
import random

import pytest

from hcache.planning.plan import Method
from hcache.planning.scheduler import LayerCosts, partition

BYTES_H, BYTES_KV = 1000, 2000  # MHA: KV is twice the hidden state


def counts(plan):
    return tuple(plan.count(m) for m in Method)


def plan_time(costs: LayerCosts, re: int, h: int, kv: int) -> float:
    """A plan's ``max(compute, io)`` where every layer costs ``costs``, written out from the module's formula
    (not through its prefix sums, which :meth:`LayerCosts.plan_time` builds for every call: 300 random cases
    of up to 48 layers took 26 s through it on a 2-core VM)."""
    compute = re * costs.c_token + h * (costs.c_h + costs.ag_h) + kv * costs.c_kv
    return max(compute, h * costs.io_h + kv * costs.io_kv)


def brute_force(costs: LayerCosts, n: int) -> float:
    return min(plan_time(costs, re, n - re - kv, kv) for re in range(n + 1) for kv in range(n - re + 1))


def paper_h_plus_kv(costs: LayerCosts, n: int) -> int:
    """L_H when C_H > IO_H (compute-bound: HCache + KV offload)."""
    return math.ceil(n * costs.io_kv / (costs.io_kv + costs.c_h - costs.io_h))


def paper_re_plus_h(costs: LayerCosts, n: int) -> int:
    """L_H when C_H ≤ IO_H (I/O-bound: token recompute + HCache)."""
    return math.ceil(n * costs.c_token / (costs.c_token + costs.io_h - costs.c_h))


SYNTHETIC = {
    # name: (costs, layers, expected (RE, H, KV)); the paper's crossing falls on an integer in each
    "compute-bound MHA": (LayerCosts(c_token=50, c_h=3, c_kv=0, io_h=1, io_kv=2), 30, (0, 15, 15)),
    "io-bound MHA": (LayerCosts(c_token=2, c_h=0, c_kv=0, io_h=1, io_kv=2), 30, (10, 20, 0)),
    "balanced MHA": (LayerCosts(c_token=20, c_h=1, c_kv=0, io_h=1, io_kv=2), 32, (0, 32, 0)),
    # hidden states outweigh K/V: H is dominated, RE fills the I/O time of KV
    "GQA": (LayerCosts(c_token=6, c_h=0.5, c_kv=0, io_h=1.5, io_kv=1.2), 30, (5, 0, 25)),
    # MHA, but the GEMM is so slow that RE + KV (the paper's naive hybrid) wins
    "slow GEMM": (LayerCosts(c_token=6, c_h=5, c_kv=0, io_h=1, io_kv=1.2), 30, (5, 0, 25)),
}


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_profiles(name):
    costs, n, expected = SYNTHETIC[name]
    plan = partition(costs, n, BYTES_H, BYTES_KV)
    assert counts(plan) == expected
    assert costs.plan_time(*counts(plan)) == pytest.approx(brute_force(costs, n), rel=1e-12)


def test_paper_closed_forms_where_they_apply():
    costs, n, _ = SYNTHETIC["compute-bound MHA"]
    assert partition(costs, n, BYTES_H, BYTES_KV).count(Method.H) == paper_h_plus_kv(costs, n)
    costs, n, _ = SYNTHETIC["io-bound MHA"]
    assert partition(costs, n, BYTES_H, BYTES_KV).count(Method.H) == paper_re_plus_h(costs, n)
    costs, n, _ = SYNTHETIC["balanced MHA"]
    assert partition(costs, n).count(Method.H) == paper_re_plus_h(costs, n) == n


def test_random_profiles_equal_brute_force_and_round_the_paper_crossing():
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for _ in range(300):
        n = rnd.randint(1, 48)
        io_h = rnd.uniform(0.1, 2)
        ratio = rnd.choice([2.0, rnd.uniform(0.3, 3)])  # MHA, or any GQA ratio
        costs = LayerCosts(
            c_token=rnd.uniform(0.1, 20),
            c_h=rnd.uniform(0.05, 4),
            c_kv=rnd.choice([0, rnd.uniform(0, 0.2)]),
            io_h=io_h,
            io_kv=io_h * ratio,
        )
        bytes_kv = int(BYTES_H * ratio)
        plan = partition(costs, n, BYTES_H, bytes_kv)
        got = counts(plan)
        assert costs.plan_time(*got) <= brute_force(costs, n) * (1 + 1e-9), (seed, costs, n, got)
        if costs.io_kv <= costs.io_h and costs.c_kv <= costs.c_h and bytes_kv <= BYTES_H:
            assert plan.count(Method.H) == 0, (seed, costs, n, got)  # never H where KV dominates it
        if costs.c_kv == 0 and ratio == 2.0 and costs.c_h > costs.io_h and plan.count(Method.RE) == 0:
            x = n * costs.io_kv / (costs.io_kv + costs.c_h - costs.io_h)
            assert plan.count(Method.H) in {math.floor(x), math.ceil(x), n}, (seed, costs, n, got)


def test_ties_go_to_the_plan_storing_fewer_bytes():
    # I/O is free, so every plan without RE takes the same time; H stores less than KV.
    costs = LayerCosts(c_token=1, c_h=0, c_kv=0, io_h=0, io_kv=0)
    assert counts(partition(costs, 8, BYTES_H, BYTES_KV)) == (0, 8, 0)


def test_without_re_the_best_h_and_kv_split_for_an_engine_that_computes_every_layer():
    """vLLM computes every layer of a token it does not load: its plans are H* KV*, the best of them."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for name, (costs, n, _) in SYNTHETIC.items():
        plan = partition(costs, n, BYTES_H, BYTES_KV, allow_re=False)
        best = min(costs.plan_time(0, n - kv, kv) for kv in range(n + 1))
        assert plan.count(Method.RE) == 0 and costs.plan_time(*counts(plan)) == pytest.approx(best, rel=1e-12), name
    io_bound = SYNTHETIC["io-bound MHA"][0]
    assert counts(partition(io_bound, 30, BYTES_H, BYTES_KV, allow_re=False)) == (0, 30, 0)  # with RE: 10RE+20H
    assert counts(partition(io_bound, 30, allow_h=False, allow_kv=False, allow_re=False)) == (
        0,
        0,
        30,
    )  # KV still loads
    for _ in range(100):
        n, costs = rnd.randint(1, 48), LayerCosts(*(rnd.uniform(0.01, 5) for _ in range(5)))
        got = counts(partition(costs, n, BYTES_H, BYTES_KV, allow_re=False))
        assert got[0] == 0 and costs.plan_time(*got) <= min(costs.plan_time(0, n - kv, kv) for kv in range(n + 1)) * (
            1 + 1e-9
        ), (seed, costs, n)


def test_layers_of_different_costs_take_the_best_split():
    """Layers that cost differently (a sliding-window layer restores its window): the partition's plan is the
    best of every RE* H* KV* split, summed layer by layer."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for _ in range(100):
        n = rnd.randint(1, 24)
        layers = [LayerCosts(*(rnd.uniform(0.01, 5) for _ in range(5))) for _ in range(n)]

        def seconds(re: int, kv: int) -> float:
            h = range(re, n - kv)
            compute = (
                sum(c.c_token for c in layers[:re])
                + sum(layers[i].c_h for i in h)
                + sum(c.c_kv for c in layers[n - kv :])
            )
            return max(compute, sum(layers[i].io_h for i in h) + sum(c.io_kv for c in layers[n - kv :]))

        plan = partition(layers, n, BYTES_H, BYTES_KV)
        best = min(seconds(re, kv) for re in range(n + 1) for kv in range(n - re + 1))
        assert seconds(plan.count(Method.RE), plan.count(Method.KV)) == pytest.approx(best, rel=1e-9), seed


def test_ties_weigh_each_layers_own_stored_bytes():
    """Stored bytes per layer (a hybrid's recurrent layer stores its state by H and KV alike): among equal
    times, the split storing fewest bytes summed layer by layer, and H dominated only where KV is no dearer on
    every layer."""
    free = LayerCosts(c_token=0, c_h=0, c_kv=0, io_h=0, io_kv=0)
    # H then KV: 3H stores 7, 2H+1KV 4, 1H+2KV 6, 3KV 8
    assert str(partition(free, 3, [1, 1, 5], [3, 3, 2], allow_re=False)) == "2H+1KV"
    assert str(partition(free, 3, [5, 5, 1], [2, 2, 3], allow_re=False)) == "3KV"  # 11, 13, 10, 7
