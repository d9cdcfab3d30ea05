"""``hcache bench fleet``'s own logic, without a fleet: which conversations go round robin, the replay's one
loop for both scenarios against a stand-in balancer, and the summary's figures. The trace on real nodes is
the benchmark itself (docs/fleet.md)."""

import zlib
from argparse import Namespace
from itertools import pairwise
from types import SimpleNamespace

import pytest

from hcache.bench import fleet as bench
from hcache.fleet.nodes import Reply


def _args(scenario: str, **kw) -> Namespace:
    workload = {"model": "m", "engine": "reference", "nodes": 2, "conversations": 6, "turns": 3}
    return Namespace(scenario=scenario, seed=0, document_words=10, max_tokens=4, **{**workload, **kw})


def test_routing_alternates_the_two_modes_and_refuses_a_round_robin_that_would_come_back_to_one_node():
    assert bench.routing_of(bench.NODE_KILLED, 4, 2) == [bench.AFFINITY] * 4
    a, r = bench.AFFINITY, bench.ROUND_ROBIN
    assert bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 6, 2) == [a, r, a, r, a, r]
    assert bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 7, 2) == [a, r, a, r, a, r, a]
    assert bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 4, 3) == [a, r, a, r]  # 2 round robin, 3 nodes
    with pytest.raises(ValueError, match="a multiple of --nodes 2.*e.g. 6"):
        bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 4, 2)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 6, 1)
    with pytest.raises(ValueError, match="at least 2 conversations"):
        bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, 1, 2)


@pytest.mark.parametrize("conversations,nodes", [(2, 2), (6, 2), (7, 2), (5, 3), (9, 3), (11, 4)])
def test_a_strict_round_robin_moves_every_round_robin_conversation_each_turn(conversations, nodes):
    """What routing_of promises: with the round-robin conversations' turns the only requests the balancer's
    round robin counts, each such conversation's turn lands on another node than its turn before."""
    routing = bench.routing_of(bench.AFFINITY_VS_ROUND_ROBIN, conversations, nodes)
    counter, placed = 0, {}
    for _ in range(4):
        for c, how in enumerate(routing):
            if how == bench.ROUND_ROBIN:
                placed.setdefault(c, []).append(counter % nodes)
                counter += 1
    assert all(a != b for turns in placed.values() for a, b in pairwise(turns))


class _Balancer:
    """A stand-in fleet: requests with a session hashed to a node, those without round robin, and each node
    reached straight at its own URL. The reply depends on the prompt alone (greedy); a node restores the
    tokens of the turn before from its cache if it served it, else from "redis"."""

    url = "http://balancer/v1"

    def __init__(self, nodes: int):
        self.nodes = [SimpleNamespace(name=f"node{i}", url=f"http://node{i}", killed=False) for i in range(nodes)]
        for n in self.nodes:
            n.kill = lambda n=n: setattr(n, "killed", True)
        self.turn_robin, self.calls, self.seen = 0, [], {}

    def node(self, name):
        return next(n for n in self.nodes if n.name == name)

    def node_for(self, session):
        alive = [n for n in self.nodes if not n.killed]
        return alive[zlib.crc32(session.encode()) % len(alive)].name

    def chat(self, base_url, model, messages, session, max_tokens, *, cache_salt=None, stream=False):
        self.calls.append((base_url, session, cache_salt))
        if base_url == self.url:
            if session is not None:
                name = self.node_for(session)
            else:
                alive = [n for n in self.nodes if not n.killed]
                name, self.turn_robin = alive[self.turn_robin % len(alive)].name, self.turn_robin + 1
        else:
            name = next(n.name for n in self.nodes if base_url == f"{n.url}/v1")
        history = tuple(m["content"] for m in messages[:-1])
        restored = {}
        if cache_salt is None and history:
            restored = {"gpu_cache" if self.seen.get(history[:-1]) == name else "redis": 64 * len(history)}
        if cache_salt is None:
            self.seen[history + (messages[-1]["content"],)] = name
        return Reply(f"reply to {len(messages)}", name, 0.5 if restored.get("gpu_cache") else 1.0, [], restored)


def _replay(monkeypatch, scenario: str, conversations: int, turns: int, nodes: int = 2):
    balancer = _Balancer(nodes)
    monkeypatch.setattr(bench, "chat", balancer.chat)
    routing = bench.routing_of(scenario, conversations, nodes)
    texts = [[f"c{c} q{t}" for t in range(turns)] for c in range(conversations)]
    kill_after = turns // 2 if scenario == bench.NODE_KILLED else None
    records, killed = bench.replay(balancer, "m", texts, routing, kill_after, 4)
    return balancer, records, killed


def test_the_replay_sends_round_robin_turns_without_a_session_and_every_recompute_straight_to_its_node(monkeypatch):
    balancer, records, killed = _replay(monkeypatch, bench.AFFINITY_VS_ROUND_ROBIN, 6, 3)
    assert killed == {} and not any(n.killed for n in balancer.nodes)
    served = [call for call in balancer.calls if call[2] is None]
    recomputes = [call for call in balancer.calls if call[2] is not None]
    assert len(served) == len(recomputes) == 18 == len(records)
    assert all(url == balancer.url for url, _, _ in served)
    assert [session for _, session, _ in served[:6]] == [f"conversation-{c}" if c % 2 == 0 else None for c in range(6)]
    assert all(url.startswith("http://node") and session is None for url, session, _ in recomputes)
    assert len({salt for _, _, salt in recomputes}) == 18  # a namespace of its own each
    returning = [r for r in records if r["turn"] > 1]
    assert all(r["moved"] == (r["routing"] == bench.ROUND_ROBIN) for r in returning)
    assert all(r["same_reply"] for r in records)
    assert all(r["restored"] == {"redis": r["turn"] * 128 - 128} for r in returning if r["moved"])


def test_the_replay_kills_the_busiest_node_half_way_and_its_conversations_move(monkeypatch):
    balancer, records, killed = _replay(monkeypatch, bench.NODE_KILLED, 6, 4)
    assert [n.name for n in balancer.nodes if n.killed] == [killed["node"]] and killed["after_turn"] == 2
    assert all(session is not None for url, session, salt in balancer.calls if salt is None)
    moved = [r for r in records if r["moved"]]
    assert {r["conversation"] for r in moved} == set(killed["conversations"])
    assert all(r["turn"] == 3 and r["after_kill"] for r in moved)


def test_the_summary_puts_round_robin_beside_affinity_with_their_ratio_and_sources(monkeypatch, capsys):
    _, records, killed = _replay(monkeypatch, bench.AFFINITY_VS_ROUND_ROBIN, 6, 3)
    records[0]["same_reply"] = False
    result = bench.summary(records, killed, {"gpu_cache": 5, "redis": 7}, _args(bench.AFFINITY_VS_ROUND_ROBIN))
    assert set(result["ttft"]) == {"affinity", "round_robin"} and "killed" not in result
    assert result["ttft"]["affinity"]["served"] == {"p50_s": 0.5, "p90_s": 0.5, "p99_s": 0.5, "n": 6}
    assert result["ttft"]["round_robin"]["served"]["p50_s"] == 1.0
    assert result["round_robin_over_affinity"] == {"p50_s": 2.0, "p90_s": 2.0}
    assert result["over_recompute"]["affinity"] == pytest.approx(0.5 / 1.0)
    assert result["turns_moved"] == {"affinity": 0, "round_robin": 6}
    assert result["restored_tokens"] == {"affinity": {"gpu_cache": 3 * 128 + 3 * 256}, "round_robin": {"redis": 1152}}
    assert result["restored_tokens_logged"] == {"gpu_cache": 5, "redis": 7}
    assert result["replies_differing"] == 1 and result["workload"]["scenario"] == bench.AFFINITY_VS_ROUND_ROBIN
    out = capsys.readouterr().out
    assert "round robin's TTFT over affinity's: p50 2.00x, p90 2.00x; 1 repl(ies) of 18 differ" in out


def test_the_summary_of_a_killed_node_names_it_and_its_moved_turns(monkeypatch, capsys):
    _, records, killed = _replay(monkeypatch, bench.NODE_KILLED, 6, 4)
    result = bench.summary(records, killed, {}, _args(bench.NODE_KILLED, turns=4))
    assert set(result["ttft"]) == {"before_kill", "after_kill", "moved"} and "round_robin_over_affinity" not in result
    assert result["killed"] == {k: killed[k] for k in ("node", "conversations", "after_turn")}
    assert result["turns_moved"]["moved"] == result["ttft"]["moved"]["served"]["n"] == len(killed["conversations"])
    assert result["over_recompute"]["moved"] == pytest.approx(1.0)  # restored from "redis": 1.0 s as recompute's
    assert f"killed {killed['node']} after turn 2: {len(killed['conversations'])} conversation(s) moved" in (
        capsys.readouterr().out
    )
