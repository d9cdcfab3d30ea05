"""A trace replayed against one server on a simulated clock: TTFT, TBT, throughput and what was restored.

The replay is event-driven, with one server serving requests first come, first served (the reference engine
serves one request at a time). Sessions arrive by the trace; each later turn arrives its think time after the
previous reply finished. Every request really runs on the server, and its measured times advance the clock,
so TTFT = queueing wait + measured time to the first token (restore, prefill) and TBT is the measured time
between consecutive tokens. Prompts are token ids drawn from ``words`` that depend only on the seed and the
turn, so every replay of a trace sends the same prompts. Replies are forced to the trace's lengths (no stop
token). Throughput is output tokens over the replay's span (first arrival to last reply); ``restore_share``
is the share of the server's busy time spent restoring; ``bytes_per_token`` is the store's bytes over the
tokens it holds, chunk headers included.
"""

from __future__ import annotations

import heapq
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from ..restore.records import GPU_CACHE
from ..storage.chunk_key import CHUNK_TOKENS
from .servers import Server
from .traces import Trace


def prompt_ids(seed: int, key: tuple[int, ...], n: int, words: np.ndarray) -> list[int]:
    """``n`` token ids drawn from ``words`` that depend only on ``seed`` and ``key``."""
    return words[np.random.default_rng([seed, *key]).integers(0, len(words), n)].tolist()


def replay(
    open_server: Callable[[str], AbstractContextManager[Server]],
    words: np.ndarray,
    trace: Trace,
    seed: int,
    *,
    prefetch: bool = True,
    on_device: bool = False,
    done: Callable[[], None] = lambda: None,
) -> dict:
    """``trace`` replayed against ``open_server(store_dir)``, a server over a store of its own (a fresh
    directory). ``prefetch``: before a request runs, each request already waiting behind it starts reading its
    stored chunks (look-ahead; ``prefetch_hidden_s`` is the read time that ran ahead of the restores).
    ``on_device``: as if every history stayed in device memory, its restores' time counted as zero and
    nothing stored off the device (``bytes_per_token`` 0). ``done()`` is called after each request."""
    sessions = trace.sessions
    ttft, tbt, restore_s, busy, restored, outputs, plans = [], [], 0.0, 0.0, 0, 0, set()
    gpu_tokens, hidden_s, replies, tiers = 0, 0.0, {}, Counter()
    with tempfile.TemporaryDirectory(prefix="hcache-replay-") as store_dir:
        with open_server(store_dir) as server:
            history = {
                i: prompt_ids(seed, (1, s.document), s.context_tokens, words) if s.context_tokens else []
                for i, s in enumerate(sessions)
            }

            def prompt_of(i: int, k: int) -> list[int]:
                return history[i] + prompt_ids(seed, (2, i, k), sessions[i].turns[k].input_tokens, words)

            queue = [(s.arrival_s, i, 0) for i, s in enumerate(sessions)]
            heapq.heapify(queue)
            clock = first = queue[0][0]
            while queue:
                arrival, i, k = heapq.heappop(queue)
                turn = sessions[i].turns[k]
                prompt = prompt_of(i, k)
                begin = max(clock, arrival)
                if prefetch:  # look-ahead: the requests waiting behind this one
                    for waiting in sorted(queue):
                        if waiting[0] <= begin:
                            server.prefetch(prompt_of(*waiting[1:]))
                start = time.perf_counter()
                r = server.generate(prompt, turn.output_tokens)
                service = time.perf_counter() - start
                free = r.restore_s if on_device else 0.0
                clock = begin + service - free
                ttft.append(begin - arrival + r.ttft_s - free)
                tbt += r.tbt_s
                busy += service - free
                restore_s += r.restore_s - free
                restored += r.restored_tokens
                gpu_tokens += r.gpu_tokens
                tiers.update(r.tier_tokens)
                hidden_s += r.prefetch_hidden_s
                outputs += len(r.output_ids)
                plans.update(step.plan for step in r.restores)
                history[i] = prompt + r.output_ids
                replies[f"{i}.{k}"] = r.output_ids
                if k + 1 < len(sessions[i].turns):
                    heapq.heappush(queue, (clock + sessions[i].turns[k + 1].think_s, i, k + 1))
                done()
        stats = server.store.stats() if server.store else None  # after close: every chunk saved is on disk
        cache = server.gpu_cache
    held = stats["stores"][0]["chunks"] * CHUNK_TOKENS if stats else 0
    return {
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tbt_mean_s": float(np.mean(tbt)) if tbt else None,
        "tbt_p99_s": float(np.percentile(tbt, 99)) if tbt else None,
        "throughput_tok_s": outputs / (clock - first),
        "restore_tokens_per_s": restored / restore_s if restored and restore_s > 0 else None,
        "bytes_per_token": 0.0 if on_device or not held else stats["stores"][0]["used_bytes"] / held,
        "restore_share": restore_s / busy,
        "requests": len(ttft),
        "restored_tokens": restored,
        "gpu_tokens": gpu_tokens,
        "tier_tokens": {GPU_CACHE: gpu_tokens, **tiers} if gpu_tokens else dict(tiers),  # restored, by where from
        "gpu_cache_hit_rate": cache.hit_tokens / max(cache.hit_tokens + cache.miss_tokens, 1) if cache else None,
        "prefetch_hidden_s": hidden_s,
        "plans": sorted(plans),
        "replies": replies,  # by "session.turn"
    }
