"""A multi-turn trace through a fleet of hcache serve nodes, one node killed half-way: TTFT against recompute.

``--conversations`` conversations each open with a document of ``--document-words`` words and go on with
short questions, ``--turns`` in all, sent in rounds (every conversation's turn 1, then every turn 2, ...)
through HAProxy, each conversation with an ``X-Session-Id`` of its own, so the hash spreads them over the
``--nodes`` nodes (:mod:`hcache.fleet`). After round ``--turns // 2`` the node holding the most
conversations is killed (SIGKILL, every process of it, as a crash), so its conversations move: their next
turn is served by another node, which restores the history from Redis. Requests are streamed, one at a
time, and TTFT is the time to the first token at the client. Each request is sent a second time in a
namespace of its own (``cache_salt``, so nothing is stored under it) to the same node: the recompute of the
same prompt, whose reply must be the same. Tokens restored come from the nodes' request logs, by source.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer

from ..fleet.nodes import Fleet, chat
from ..machine.ports import free_port
from ..model.loader import DEFAULT_MODEL, model_dir
from ._conversations import conversations_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--engine", default="auto", choices=["auto", "fastgen", "reference"], help="as for hcache serve"
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--redis", default=None, metavar="URL", help="a running Redis (default: the fleet starts one)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument(
        "--turns", type=int, default=4, help="turns per conversation; the kill comes after half of them"
    )
    parser.add_argument(
        "--document-words", type=int, default=800, help="words of the document each conversation opens with"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length cap")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    if args.turns < 2:
        raise ValueError(f"--turns must be at least 2 (the kill comes after half of them), not {args.turns}")
    path = str(model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversations = conversations_of(tokenizer, args.conversations, args.turns, args.document_words, args.seed)
    with tempfile.TemporaryDirectory(prefix="hcache-bench-fleet-") as tmp:
        serve_args = ["--model", path, "--engine", args.engine]
        with Fleet(args.nodes, tmp, redis_url=args.redis, port=free_port(), serve_args=serve_args) as fleet:
            records, killed = _replay(fleet, path, conversations, args)
            restored = _restored_by_source(fleet, killed["time"])
    return _summary(records, killed, restored, args)


def _replay(fleet: Fleet, model: str, conversations: list[list[str]], args) -> tuple[list[dict], dict]:
    """Rounds of turns; the kill after half of them. One record per request: its TTFT served as is and
    recomputed, and whether the replies agree."""
    sessions = [f"conversation-{c}" for c in range(len(conversations))]
    histories: list[list[dict]] = [[] for _ in conversations]
    records, killed = [], {}
    with tqdm(total=len(conversations) * args.turns, desc="fleet trace", unit="turn") as bar:
        for turn in range(args.turns):
            if turn == args.turns // 2:
                killed = _kill_busiest(fleet, sessions)
            for c, (messages, session) in enumerate(zip(histories, sessions)):
                messages.append({"role": "user", "content": conversations[c][turn]})
                served = chat(fleet.url, model, messages, session, args.max_tokens, stream=True)
                salt = f"recompute-{c}-{turn}"  # a namespace with nothing stored: the whole prompt is prefilled
                recomputed = chat(fleet.url, model, messages, session, args.max_tokens, stream=True, cache_salt=salt)
                messages.append({"role": "assistant", "content": served.text})
                moved = bool(killed) and turn == args.turns // 2 and c in killed["conversations"]
                records.append(
                    {
                        "conversation": c,
                        "turn": turn + 1,
                        "node": served.node,
                        "after_kill": bool(killed),
                        "moved": moved,
                        "ttft_s": served.ttft_s,
                        "recompute_ttft_s": recomputed.ttft_s,
                        "same_reply": served.text == recomputed.text,
                    }
                )
                bar.update()
    return records, killed


def _kill_busiest(fleet: Fleet, sessions: list[str]) -> dict:
    """SIGKILL the node the most conversations go to; which it was, its conversations, and when."""
    owners = [fleet.node_for(s) for s in sessions]
    name = max(sorted(set(owners)), key=owners.count)
    node = next(n for n in fleet.nodes if n.name == name)
    node.kill()
    return {"node": name, "conversations": [c for c, owner in enumerate(owners) if owner == name], "time": time.time()}


def _restored_by_source(fleet: Fleet, kill_time: float) -> dict:
    """Tokens restored by source, before and after the kill, from every node's request log (a killed node's
    is on disk still); recompute requests restore nothing (their namespaces are new)."""
    out = {"before_kill": {}, "after_kill": {}}
    for node in fleet.nodes:
        for line in node.request_log.read_text().splitlines() if node.request_log.exists() else []:
            entry = json.loads(line)
            phase = out["after_kill" if entry["time"] > kill_time else "before_kill"]
            for source, n in {"gpu_cache": entry["gpu_tokens"], **entry["tier_tokens"]}.items():
                if not n:
                    continue
                phase[source] = phase.get(source, 0) + n
    return out


def _percentiles(values: list[float]) -> dict:
    return (
        {"p50_s": float(np.percentile(values, 50)), "p99_s": float(np.percentile(values, 99)), "n": len(values)}
        if values
        else {}
    )


def _summary(records: list[dict], killed: dict, restored: dict, args) -> dict:
    def ttft(select) -> dict:
        chosen = [r for r in records if select(r)]
        return {
            "served": _percentiles([r["ttft_s"] for r in chosen]),
            "recompute": _percentiles([r["recompute_ttft_s"] for r in chosen]),
        }

    returning = {  # turns after the first: the history is restored (or recomputed)
        "before_kill": ttft(lambda r: r["turn"] > 1 and not r["after_kill"]),
        "after_kill": ttft(lambda r: r["after_kill"]),
        "moved": ttft(lambda r: r["moved"]),
    }
    moved = returning["moved"]
    ratio = moved["served"]["p50_s"] / moved["recompute"]["p50_s"] if moved["served"] else None
    result = {
        "ttft": returning,
        "moved_ttft_p50_over_recompute": ratio,
        "replies_differing": sum(not r["same_reply"] for r in records),
        "restored_tokens": restored,
        "killed": {k: v for k, v in killed.items() if k != "time"},
        "requests": records,
        "workload": {
            k: getattr(args, k)
            for k in ("model", "engine", "nodes", "conversations", "turns", "document_words", "max_tokens", "seed")
        },
    }
    for phase, figures in returning.items():
        if figures["served"]:
            print(
                f"{phase:12s} TTFT p50 {figures['served']['p50_s']:.3f} s, p99 {figures['served']['p99_s']:.3f} s; "
                f"recompute p50 {figures['recompute']['p50_s']:.3f} s, p99 {figures['recompute']['p99_s']:.3f} s  ({figures['served']['n']} turns)"
            )
    print(
        f"killed {killed['node']} after turn {args.turns // 2}: {len(killed['conversations'])} conversation(s) moved; "
        f"their TTFT p50 is {ratio:.2f}x recompute's; {result['replies_differing']} repl(ies) differ"
    )
    print(f"tokens restored by source: before the kill {restored['before_kill']}, after {restored['after_kill']}")
    return result
