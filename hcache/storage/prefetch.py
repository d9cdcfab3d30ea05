"""Look-ahead prefetch: requests waiting to run start reading their stored chunks from disk into the host
pool while earlier requests run (AttentionStore's scheduler-aware pre-loading), so that their restores
find the chunks in memory.

A prefetch only loads: it releases each chunk as soon as it is in the pool, so it never holds pool memory
a running restore needs (a chunk evicted again before its restore is simply read again). Each load's start
and end times are kept until a restore reads the chunk: the part of its read that ran before the restore
began is the time prefetch hid, reported per restore.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from .host_tier import HostTier

MAX_TRACKED = 4096  # load records kept for restores that never come (the request found its state elsewhere)


class Prefetcher:
    def __init__(self, tier: HostTier):
        self.tier = tier
        self.chunks = 0  # loads started
        self._lock = threading.Lock()
        self._loads: OrderedDict[str, list] = OrderedDict()  # key -> [started, finished or None]

    def prefetch(self, keys: list[str]) -> int:
        """Start loading the leading stored chunks of ``keys`` that are not in memory; how many started."""
        started = 0
        for key in keys[: self.tier.stored_prefix(keys)]:  # one batched look-up
            with self._lock:
                if key in self._loads:
                    continue
            if self.tier.resident(key):
                continue
            times = [time.perf_counter(), None]
            with self._lock:
                self._loads[key] = times
                while len(self._loads) > MAX_TRACKED:
                    self._loads.popitem(last=False)
            self.tier.fetch(key).add_done_callback(lambda f, times=times: self._loaded(f, times))
            started += 1
        self.chunks += started
        return started

    def _loaded(self, future: Future, times: list) -> None:
        times[1] = time.perf_counter()
        try:
            image = future.result()
        except Exception:  # unreadable or bad: the restore finds out again and falls back
            return
        if image is not None:
            self.tier.release(image)

    def hidden(self, keys: list[str]) -> float:
        """Seconds of reading ``keys`` that ran before now, when a restore is about to read them; forgets them."""
        now, total = time.perf_counter(), 0.0
        with self._lock:
            for key in keys:
                times = self._loads.pop(key, None)
                if times is not None:
                    total += (times[1] if times[1] is not None else now) - times[0]
        return total
