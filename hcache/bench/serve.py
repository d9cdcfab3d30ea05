"""`hcache serve` under vLLM's multi-turn client shape: TTFT by turn, time per token and request latency, restoring against recomputing, beside the engine's own decode step.

``--conversations`` conversations of ``--turns`` turns (a document of ``--document-words`` words, then
questions), streamed and greedy, run by ``--concurrency`` clients at a time (each level in turn; a client
takes a conversation and sends its turns one after another, as vLLM's
``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` does) against one ``hcache serve`` on the
reference engine. Each turn is sent twice, interleaved: as is (its history restored) and under a
``cache_salt`` of its own, where nothing is stored, so it is recomputed by the same server: a like-for-like
baseline, whose reply must be the same. Before and after the traffic, with the server idle, the same model
on :class:`~hcache.serving.runtime.HCacheRuntime` decodes a batch of as many prompts as there are clients:
its time per step is what the serving path adds to (``per_token_over_engine``). That baseline only
decodes, while the server's steps at several clients also prefill other clients' turns (a recomputed
turn prefills its whole history); so the server's own steps are timed too, in the same run: for each
token it decoded, the step that decoded it (its ``hcache_decoded_tokens_total`` and
``hcache_decoded_token_seconds_total`` counters, read before and after each level). A client's time
between two tokens is one such step and the serving path around it: ``per_token_over_step`` is the
clients' mean over the server's, like for like.

With ``--vllm`` (vLLM installed), the same conversations then go, one server at a time, to ``vllm serve``
with hcache's connector (restoring and, under a fresh ``cache_salt``, recomputing, interleaved) and to
plain ``vllm serve`` (its own prefix cache, and a fresh ``cache_salt`` for its recompute), on the same
model in float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer

from ..machine import process_tree
from ..fleet.nodes import Node, Reply, chat
from ..model.loader import DEFAULT_MODEL, model_dir
from ..machine.ports import free_port
from ._conversations import conversations_of
from .vllm import reserve_cpus_alike


VLLM_START_S = 600
VLLM_MEMORY = (
    0.25  # of the machine's memory, for vLLM's CPU KV cache (its default, 0.92, leaves nothing to this process)
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--document-words", type=int, default=300, help="words of the document each conversation opens with"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length cap")
    parser.add_argument("--concurrency", default="1,8", help="clients at once, each level in turn (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="also vllm serve, with hcache's connector and without")


def run(args: argparse.Namespace) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.turns < 1 or args.conversations < max(levels):
        raise SystemExit(
            f"--concurrency must be positive and at most --conversations ({args.conversations}), not {args.concurrency}"
        )
    path = str(model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    result: dict = {
        "workload": {
            k: getattr(args, k)
            for k in ("model", "conversations", "turns", "document_words", "max_tokens", "concurrency", "seed")
        }
    }
    with tempfile.TemporaryDirectory(prefix="hcache-bench-serve-") as tmp:
        first_turns = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": c[0]}], tokenize=False, add_generation_prompt=True
                )
            )
            for c in conversations_of(tokenizer, max(levels), 1, args.document_words, args.seed)
        ]
        engine_before = _engine_step(path, Path(tmp) / "engine", first_turns, levels, args.max_tokens)
        node = Node(0, Path(tmp) / "serve", ["--model", path, "--engine", "reference"])
        node.start()
        try:
            node.wait_ready()
            for level in levels:
                before = _steps(node.metrics_url)
                result[f"c{level}"] = _traffic(
                    f"{node.url}/v1", path, _conversations(tokenizer, args, level), level, args.max_tokens
                )
                tokens, seconds = (after - then for after, then in zip(_steps(node.metrics_url), before))
                result[f"c{level}"]["server_step_s"] = {"mean_per_token": seconds / tokens, "tokens": tokens}
        finally:
            node.stop()
        engine_after = _engine_step(path, Path(tmp) / "engine", first_turns, levels, args.max_tokens)
        if args.vllm:
            result.update(reserve_cpus_alike())
            from ..vllm.settings import kv_transfer_config

            connector = kv_transfer_config({"store_dirs": [str(Path(tmp) / "vllm-store")]})
            for name, transfer in (("vllm_hcache", connector), ("vllm", None)):
                try:
                    with _vllm_serve(path, transfer, Path(tmp) / f"{name}.log") as url:
                        for level in levels:
                            result[f"c{level}"][name] = _traffic(
                                url, path, _conversations(tokenizer, args, level), level, args.max_tokens
                            )
                except RuntimeError as exc:  # hcache serve's figures stand; say why vLLM's are missing
                    print(f"{name}: {exc}")
                    result[f"{name}_error"] = str(exc)
    for level in levels:
        step = float(np.mean([engine_before[level], engine_after[level]]))
        figures = result[f"c{level}"]
        figures["engine_step_s"] = {"before": engine_before[level], "after": engine_after[level]}
        figures["per_token_over_engine"] = figures["restore"]["per_token_s"]["p50"] / step
        figures["per_token_over_step"] = figures["per_token_s_mean"] / figures["server_step_s"]["mean_per_token"]
        _print(level, figures, step)
    return result


def _conversations(tokenizer, args, level: int) -> list[list[str]]:
    """The conversations of a concurrency level: each level's are its own, so none restores another's."""
    return conversations_of(tokenizer, args.conversations, args.turns, args.document_words, args.seed + level)


@contextmanager
def _vllm_serve(path: str, transfer: dict | None, log: Path) -> Iterator[str]:
    """``vllm serve`` of ``path`` in float32 (with ``transfer`` as its KV transfer config) until the block
    ends; its OpenAI API's base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--gpu-memory-utilization",
        str(VLLM_MEMORY),
    ]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + VLLM_START_S
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                errors = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line]
                raise RuntimeError("vllm serve did not start:\n" + "\n".join(errors[-20:]))
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        started = process_tree.tree(server.pid)
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            pass
        process_tree.kill(process_tree.running(started))
        server.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _steps(metrics_url: str) -> tuple[float, float]:
    """The tokens the server decoded so far, and for each, the seconds of its step, summed (its Prometheus counters)."""
    names = ("hcache_decoded_tokens_total", "hcache_decoded_token_seconds_total")
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(tuple(f"{n} " for n in names)))
    return float(values[names[0]]), float(values[names[1]])


def _engine_step(
    path: str, store: Path, prompts: list[list[int]], levels: list[int], new_tokens: int
) -> dict[int, float]:
    """The median time between two tokens of ``HCacheRuntime`` decoding a batch of ``level`` prompts, saving
    as the server does: for each level."""
    from ..serving.runtime import HCacheRuntime

    steps = {}
    with HCacheRuntime(path, store, self_check="off") as runtime:
        runtime.generate(prompts[0][:16], 2)  # warm
        for level in levels:
            results = runtime.generate_batch(prompts[:level], new_tokens, restore=False, stop_token_ids=set())
            steps[level] = float(np.median([gap for r in results for gap in r.tbt_s]))
    return steps


def _traffic(url: str, model: str, conversations: list[list[str]], clients: int, max_tokens: int) -> dict:
    """Every conversation's turns, ``clients`` conversations at a time; each turn as is and recomputed."""
    records: list[dict] = []
    bar = tqdm(total=len(conversations) * len(conversations[0]), desc=f"{clients} client(s)", unit="turn")

    def converse(c: int) -> None:
        messages: list[dict] = []
        for turn, question in enumerate(conversations[c]):
            messages.append({"role": "user", "content": question})
            asked = {
                "base_url": url,
                "model": model,
                "messages": messages,
                "session": f"c{c}",
                "max_tokens": max_tokens,
                "stream": True,
            }
            start = time.perf_counter()
            served = chat(**asked)
            served_s = time.perf_counter() - start
            start = time.perf_counter()
            recomputed = chat(**asked, cache_salt=f"recompute-{c}-{turn}-{time.time_ns()}")
            recomputed_s = time.perf_counter() - start
            messages.append({"role": "assistant", "content": served.text})
            records.append(
                {
                    "conversation": c,
                    "turn": turn + 1,
                    "same_reply": served.text == recomputed.text,
                    "restore": _timing(served, served_s),
                    "recompute": _timing(recomputed, recomputed_s),
                }
            )
            bar.update()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(converse, range(len(conversations))))
    bar.close()
    turns = len(conversations[0])
    out: dict = {
        "replies_differing": sum(not r["same_reply"] for r in records),
        "requests": len(records),
        "per_token_s_mean": float(
            np.mean(
                [
                    r[arm]["per_token_s"]
                    for r in records
                    for arm in ("restore", "recompute")
                    if r[arm]["per_token_s"] is not None
                ]
            )
        ),
    }
    for arm in ("restore", "recompute"):
        timings = [r[arm] for r in records]
        out[arm] = {
            "ttft_s_by_turn": {
                t: _p50([r[arm]["ttft_s"] for r in records if r["turn"] == t]) for t in range(1, turns + 1)
            },
            "per_token_s": _spread([x["per_token_s"] for x in timings if x["per_token_s"] is not None]),
            "latency_s": _spread([x["latency_s"] for x in timings]),
        }
    return out


def _timing(reply: Reply, latency_s: float) -> dict:
    gaps = np.diff(reply.token_s)
    return {"ttft_s": reply.ttft_s, "latency_s": latency_s, "per_token_s": float(np.mean(gaps)) if len(gaps) else None}


def _p50(values: list[float]) -> float:
    return float(np.percentile(values, 50))


def _spread(values: list[float]) -> dict:
    return {"p50": _p50(values), "p90": float(np.percentile(values, 90)), "n": len(values)}


def _print(level: int, figures: dict, step: float) -> None:
    restore, recompute = figures["restore"], figures["recompute"]
    print(
        f"{level} client(s): engine step {step * 1e3:.0f} ms; per token at the client {restore['per_token_s']['p50'] * 1e3:.0f} ms restoring, "
        f"{recompute['per_token_s']['p50'] * 1e3:.0f} ms recomputing ({figures['per_token_over_engine']:.2f}x the engine's step); "
        f"the server's steps {figures['server_step_s']['mean_per_token'] * 1e3:.0f} ms a token, the clients' {figures['per_token_s_mean'] * 1e3:.0f} ms "
        f"({figures['per_token_over_step']:.2f}x); "
        f"latency p50 {restore['latency_s']['p50']:.2f} s vs {recompute['latency_s']['p50']:.2f} s; "
        f"{figures['replies_differing']} of {figures['requests']} replies differ"
    )
    for turn, ttft in restore["ttft_s_by_turn"].items():
        print(f"  turn {turn}: TTFT p50 {ttft:.3f} s restoring, {recompute['ttft_s_by_turn'][turn]:.3f} s recomputing")
    for name in ("vllm_hcache", "vllm"):
        if name in figures:
            served, again = figures[name]["restore"], figures[name]["recompute"]
            print(
                f"  {name}: per token {served['per_token_s']['p50'] * 1e3:.0f} ms ({again['per_token_s']['p50'] * 1e3:.0f} ms recomputing); "
                f"returning turns' TTFT p50 {_p50(list(served['ttft_s_by_turn'].values())[1:] or [0]):.3f} s vs "
                f"{_p50(list(again['ttft_s_by_turn'].values())[1:] or [0]):.3f} s recomputing"
            )
