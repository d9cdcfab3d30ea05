"""A multi-turn trace through a fleet of hcache serve nodes: TTFT with a node killed, or routed by conversation against round robin.

``--conversations`` conversations each open with a document of ``--document-words`` words and go on with
short questions, ``--turns`` in all, sent in rounds (every conversation's turn 1, then every turn 2, ...)
through HAProxy to ``--nodes`` nodes (:mod:`hcache.fleet`). ``--scenario``:

- ``node-killed`` (the default): each conversation with an ``X-Session-Id`` of its own, so the hash spreads
  them over the nodes. After round ``--turns // 2`` the node holding the most conversations is killed
  (SIGKILL, every process of it, as a crash), so its conversations move: their next turn is served by
  another node, which restores the history from Redis.
- ``affinity-vs-round-robin``: every other conversation (the 1st, 3rd, ...) sends its header, so each of its
  turns goes back to the node that holds its history (affinity); the others send none, so the balancer
  sends their turns round robin, each to another node than the turn before, which restores from Redis what
  it lacks. The two kinds alternate within each round, so both see the same load, on the same fleet.

Requests are streamed, one at a time, and TTFT is the time to the first token at the client. Each request
is sent a second time, straight to the node that answered it (not through the balancer, whose round robin
it would otherwise shift), in a namespace of its own (``cache_salt``, so nothing stored is found): the
recompute of the same prompt, whose reply must be the same. Tokens restored by source are each answer's
(its ``hcache`` object, which says what the node's request log says), summed per group of turns; the request
logs' totals are kept beside them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer

from ..fleet.nodes import Fleet, chat
from ..machine.ports import free_port
from ..model.loader import DEFAULT_MODEL, model_dir
from ._conversations import conversations_of

NODE_KILLED, AFFINITY_VS_ROUND_ROBIN = "node-killed", "affinity-vs-round-robin"
AFFINITY, ROUND_ROBIN = "affinity", "round-robin"  # how a conversation's turns are routed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--engine", default="auto", choices=["auto", "fastgen", "reference"], help="as for hcache serve"
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--redis", default=None, metavar="URL", help="a running Redis (default: the fleet starts one)")
    parser.add_argument(
        "--scenario",
        default=NODE_KILLED,
        choices=[NODE_KILLED, AFFINITY_VS_ROUND_ROBIN],
        help=f"{NODE_KILLED}: every conversation routed by its X-Session-Id, the busiest node killed half-way; "
        f"{AFFINITY_VS_ROUND_ROBIN}: every other conversation without the header (round robin), side by side",
    )
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument(
        "--turns", type=int, default=4, help=f"turns per conversation; {NODE_KILLED}: the kill comes after half of them"
    )
    parser.add_argument(
        "--document-words", type=int, default=800, help="words of the document each conversation opens with"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length cap")
    parser.add_argument("--seed", type=int, default=0)


def routing_of(scenario: str, conversations: int, nodes: int) -> list[str]:
    """Each conversation's routing: by conversation (:data:`AFFINITY`) for every one with a node killed;
    alternately by conversation and :data:`ROUND_ROBIN` for affinity against round robin.

    The balancer's round robin turns for requests without the header alone, and within a round those are the
    round-robin conversations' turns (the recomputes go straight to the nodes): so a conversation's next turn
    lands ``k mod nodes`` nodes on from its last, ``k`` round-robin conversations. A multiple of the nodes
    would bring each back to the node of its turn before, as affinity does; that is refused."""
    if scenario == NODE_KILLED:
        return [AFFINITY] * conversations
    if nodes < 2:
        raise ValueError(f"--scenario {scenario} needs at least 2 nodes, not {nodes}")
    routing = [AFFINITY if c % 2 == 0 else ROUND_ROBIN for c in range(conversations)]
    k = routing.count(ROUND_ROBIN)
    if k == 0:
        raise ValueError(f"--scenario {scenario} needs at least 2 conversations (one routed each way)")
    if k % nodes == 0:
        raise ValueError(
            f"--conversations {conversations} sends {k} round robin, a multiple of --nodes {nodes}: each would "
            f"come back to the node of its turn before; choose another count (e.g. {conversations + 2})"
        )
    return routing


def run(args: argparse.Namespace) -> dict:
    if args.turns < 2:
        raise ValueError(
            f"--turns must be at least 2 (returning turns, and the kill after half of them), not {args.turns}"
        )
    routing = routing_of(args.scenario, args.conversations, args.nodes)
    path = str(model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversations = conversations_of(tokenizer, args.conversations, args.turns, args.document_words, args.seed)
    kill_after = args.turns // 2 if args.scenario == NODE_KILLED else None
    with tempfile.TemporaryDirectory(prefix="hcache-bench-fleet-") as tmp:
        serve_args = ["--model", path, "--engine", args.engine]
        fleet = Fleet(args.nodes, tmp, redis_url=args.redis, port=free_port(), serve_args=serve_args)
        with fleet:
            records, killed = replay(fleet, path, conversations, routing, kill_after, args.max_tokens)
        logged = _logged_by_source(fleet)  # each node drained (a killed one is gone): every line is in
    return summary(records, killed, logged, args)


def replay(
    fleet: Fleet,
    model: str,
    conversations: list[list[str]],
    routing: list[str],
    kill_after: int | None,
    max_tokens: int,
) -> tuple[list[dict], dict]:
    """Rounds of turns, each conversation routed as ``routing`` says; the busiest node killed before turn
    ``kill_after`` (counted from 0), if given. One record per request: the node that served it and whether it
    served the turn before, its TTFT served as is and recomputed, whether the replies agree, and the tokens
    it restored by source."""
    sessions = [f"conversation-{c}" if how == AFFINITY else None for c, how in enumerate(routing)]
    histories: list[list[dict]] = [[] for _ in conversations]
    last_node: list[str | None] = [None for _ in conversations]
    turns = len(conversations[0]) if conversations else 0
    records, killed = [], {}
    with tqdm(total=len(conversations) * turns, desc="fleet trace", unit="turn") as bar:
        for turn in range(turns):
            if turn == kill_after:
                killed = {**_kill_busiest(fleet, sessions), "after_turn": turn}
            for c, (messages, session) in enumerate(zip(histories, sessions)):
                messages.append({"role": "user", "content": conversations[c][turn]})
                served = chat(fleet.url, model, messages, session, max_tokens, stream=True)
                salt = f"recompute-{c}-{turn}"  # a namespace with nothing stored: the whole prompt is prefilled
                node_url = f"{fleet.node(served.node).url}/v1"
                recomputed = chat(node_url, model, messages, None, max_tokens, stream=True, cache_salt=salt)
                messages.append({"role": "assistant", "content": served.text})
                records.append(
                    {
                        "conversation": c,
                        "turn": turn + 1,
                        "routing": routing[c],
                        "node": served.node,
                        "moved": turn > 0 and served.node != last_node[c],  # another node than the turn before's
                        "after_kill": bool(killed),
                        "ttft_s": served.ttft_s,
                        "recompute_ttft_s": recomputed.ttft_s,
                        "same_reply": served.text == recomputed.text,
                        "restored": served.restored or {},
                    }
                )
                last_node[c] = served.node
                bar.update()
    return records, killed


def _kill_busiest(fleet: Fleet, sessions: list[str | None]) -> dict:
    """SIGKILL the node the most conversations (of those with a session) go to; which it was, its
    conversations, and when."""
    owners = {c: fleet.node_for(s) for c, s in enumerate(sessions) if s is not None}
    counts = Counter(owners.values())
    name = max(sorted(counts), key=counts.__getitem__)
    fleet.node(name).kill()
    return {"node": name, "conversations": [c for c, owner in owners.items() if owner == name], "time": time.time()}


def _logged_by_source(fleet: Fleet) -> dict[str, int]:
    """Tokens restored by source over every line of every node's request log (recompute requests restore
    nothing: their namespaces are new)."""
    lines = [
        json.loads(line)
        for node in fleet.nodes
        if node.request_log.exists()
        for line in node.request_log.read_text().splitlines()
    ]
    return _by_source({"gpu_cache": entry["gpu_tokens"], **entry["tier_tokens"]} for entry in lines)


def _by_source(restores: Iterable[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for restored in restores:
        total.update(restored)
    return {source: n for source, n in sorted(total.items()) if n}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    p50, p90, p99 = (float(np.percentile(values, q)) for q in (50, 90, 99))
    return {"p50_s": p50, "p90_s": p90, "p99_s": p99, "n": len(values)}


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if a and b and b[key] else None


def groups_of(scenario: str) -> dict[str, Callable[[dict], bool]]:
    """The turns each figure is taken over, by name: returning turns (the history is restored, or recomputed)."""
    if scenario == NODE_KILLED:
        return {
            "before_kill": lambda r: r["turn"] > 1 and not r["after_kill"],
            "after_kill": lambda r: r["after_kill"],
            "moved": lambda r: r["moved"],  # the killed node's conversations, on their next turn
        }
    return {
        "affinity": lambda r: r["turn"] > 1 and r["routing"] == AFFINITY,
        "round_robin": lambda r: r["turn"] > 1 and r["routing"] == ROUND_ROBIN,
    }


def summary(records: list[dict], killed: dict, logged: dict[str, int], args) -> dict:
    """The figures of a replay, by group of turns (:func:`groups_of`): TTFT served and recomputed (p50, p90,
    p99), the served p50 over the recompute's, how many turns moved node, and tokens restored by source; for
    affinity against round robin, round robin's TTFT over affinity's. Printed, and returned for ``--json``."""
    groups = {name: [r for r in records if select(r)] for name, select in groups_of(args.scenario).items()}
    ttft = {
        name: {
            "served": _percentiles([r["ttft_s"] for r in chosen]),
            "recompute": _percentiles([r["recompute_ttft_s"] for r in chosen]),
        }
        for name, chosen in groups.items()
    }
    result = {
        "scenario": args.scenario,
        "ttft": ttft,
        "over_recompute": {name: _ratio(t["served"], t["recompute"], "p50_s") for name, t in ttft.items()},
        "turns_moved": {name: sum(r["moved"] for r in chosen) for name, chosen in groups.items()},
        "replies_differing": sum(not r["same_reply"] for r in records),
        "restored_tokens": {name: _by_source(r["restored"] for r in chosen) for name, chosen in groups.items()},
        "restored_tokens_logged": logged,
    }
    if args.scenario == AFFINITY_VS_ROUND_ROBIN:
        rr, aff = ttft["round_robin"]["served"], ttft["affinity"]["served"]
        result["round_robin_over_affinity"] = {q: _ratio(rr, aff, q) for q in ("p50_s", "p90_s")}
    else:
        result["killed"] = {k: v for k, v in killed.items() if k != "time"}
    result["requests"] = records
    result["workload"] = {
        k: getattr(args, k)
        for k in (
            "model",
            "engine",
            "nodes",
            "scenario",
            "conversations",
            "turns",
            "document_words",
            "max_tokens",
            "seed",
        )
    }
    _print(result)
    return result


def _print(result: dict) -> None:
    for name, figures in result["ttft"].items():
        served, recompute = figures["served"], figures["recompute"]
        if served:
            print(
                f"{name:12s} TTFT p50 {served['p50_s']:.3f} s, p90 {served['p90_s']:.3f} s; recompute p50 "
                f"{recompute['p50_s']:.3f} s, p90 {recompute['p90_s']:.3f} s; p50 {result['over_recompute'][name]:.2f}x "
                f"recompute's; {result['turns_moved'][name]} of {served['n']} turns on another node than the turn "
                f"before; restored {result['restored_tokens'][name]}"
            )
    differing = f"{result['replies_differing']} repl(ies) of {len(result['requests'])} differ from the recompute"
    if result["scenario"] == AFFINITY_VS_ROUND_ROBIN:
        ratio = result["round_robin_over_affinity"]
        if ratio["p50_s"] is not None:
            print(
                f"round robin's TTFT over affinity's: p50 {ratio['p50_s']:.2f}x, p90 {ratio['p90_s']:.2f}x; {differing}"
            )
    else:
        killed, moved = result["killed"], result["over_recompute"]["moved"]
        print(
            f"killed {killed['node']} after turn {killed['after_turn']}: {len(killed['conversations'])} "
            "conversation(s) moved"
            + (f"; their TTFT p50 is {moved:.2f}x recompute's" if moved is not None else "")
            + f"; {differing}"
        )
    print(f"tokens restored by source, every request, from the nodes' request logs: {result['restored_tokens_logged']}")
