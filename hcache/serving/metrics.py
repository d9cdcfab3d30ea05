"""The serving engine's counters, for Prometheus (``prometheus-client``) and from Python.

The serving engine counts what only it sees (tokens restored by source and method, bytes read by tier,
fallbacks, prefetch); the GPU prefix cache and the host tier keep their own counts, read when the registry
is collected, so nothing is counted twice. Each serving engine has a registry of its own:
``hcache serve`` exposes it over HTTP (:func:`serve_metrics`), and :meth:`ServingMetrics.snapshot` reads
it as a dict, e.g. ``snapshot()['hcache_gpu_cache_hit_tokens_total']``.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..planning.plan import Method
from ..storage.stored_state import Source
from ..restore.records import GPU_CACHE, MissReason


class ServingMetrics:
    """``store`` (a host tier), ``prefetcher`` and ``gpu_cache``: the serving engine's parts whose own
    counts are read at collection time (each may be None)."""

    def __init__(self, store=None, prefetcher=None, gpu_cache=None):
        self.store, self.prefetcher, self.gpu_cache = store, prefetcher, gpu_cache
        self.restored_tokens: Tally = Tally()  # by source: gpu_cache, host (the pool), then each store's kind
        self.restored_layer_tokens: Tally = Tally()  # from the store: tokens x layers, by method (RE, H, KV)
        self.bytes_read: Tally = Tally()  # by tier: gpu (the prefix cache's copies), host (host pool to device)
        self.miss_tokens: Tally = Tally()  # full-chunk tokens computed instead of restored, by MissReason
        self.fallbacks = 0  # restores that used stored state only in part
        self.prefetch_hidden_s = 0.0
        self.sequences = 0  # finished
        self.steps = 0  # puts, each a step of the engine: restores, one forward, saving
        self.step_s = 0.0  # their wall time, from call to return
        self.decoded = 0  # tokens decoded: sequences' one-token puts
        self.decoded_step_s = 0.0  # for each, the wall time of the step that decoded it
        self.self_check_disabled: frozenset[str] = frozenset()  # methods the start-up self-check disabled
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def stepped(self, seconds: float, decoded: int) -> None:
        """A step of ``seconds`` that decoded ``decoded`` tokens (and may have prefilled more)."""
        self.steps += 1
        self.step_s += seconds
        self.decoded += decoded
        self.decoded_step_s += decoded * seconds

    def add(self, step) -> None:
        """Count one put's restore (a :class:`~hcache.restore.records.PutRestore`)."""
        self.restored_tokens.update(step.sources)
        if step.gpu_tokens:
            self.restored_tokens[GPU_CACHE] += step.gpu_tokens
            self.bytes_read["gpu"] += step.gpu_bytes
        if step.plan:  # the store was tried
            self.bytes_read[Source.HOST.value] += step.bytes_read
            self.restored_layer_tokens.update(step.layer_tokens)
            self.fallbacks += step.fallback is not None
        self.prefetch_hidden_s += step.hidden_s
        self.miss_tokens.update(step.misses)

    def collect(self):
        cache = self.gpu_cache
        tier = self.store.stats() if self.store is not None else {}
        sources = [GPU_CACHE] * (cache is not None) + [Source.HOST.value, *(s.kind for s in self.store.stores)] * (
            self.store is not None
        )
        counters = [  # name, help, value (or {label value: value}), label
            (
                "hcache_restored_tokens",
                "Tokens restored instead of prefilled, by source: the GPU prefix cache, the host pool "
                "(host), or the store a chunk was read from (disk, shared_disk, redis)",
                {**dict.fromkeys(sources, 0), **self.restored_tokens},
                "source",
            ),
            (
                "hcache_restored_layer_tokens",
                "Tokens times layers restored from the store, by method",
                self.restored_layer_tokens,
                "method",
            ),
            (
                "hcache_bytes_read",
                "Bytes read by restores, by tier (store: from the stores below into the host pool)",
                {**self.bytes_read, "store": tier.get("bytes_loaded", 0)},
                "tier",
            ),
            (
                "hcache_store_write_errors",
                "Chunk writes a store below the host pool refused (the chunk stays in memory)",
                tier.get("write_errors", 0),
                None,
            ),
            (
                "hcache_miss_tokens",
                "Tokens of stored-size chunks computed instead of restored, by why the stored prefix ended",
                {**{r: 0 for r in MissReason}, **self.miss_tokens},
                "reason",
            ),
            ("hcache_fallbacks", "Restores that used stored state only in part", self.fallbacks, None),
            ("hcache_sequences", "Sequences finished", self.sequences, None),
            ("hcache_steps", "Steps the serving engine ran (puts: restores, one forward, saving)", self.steps, None),
            (
                "hcache_step_seconds",
                "Seconds the serving engine spent in its steps, from a put's call to its return (on a GPU "
                "its device work may end later)",
                self.step_s,
                None,
            ),
            ("hcache_decoded_tokens", "Tokens decoded (sequences' one-token puts)", self.decoded, None),
            (
                "hcache_decoded_token_seconds",
                "For each token decoded, the seconds of the step that decoded it: over "
                "hcache_decoded_tokens_total, the engine's time between two tokens as a client sees it, before the serving path's",
                self.decoded_step_s,
                None,
            ),
            (
                "hcache_prefetch_hidden_seconds",
                "Seconds of disk reads that look-ahead prefetch ran before their restore",
                self.prefetch_hidden_s,
                None,
            ),
            (
                "hcache_prefetched_chunks",
                "Chunk loads started by look-ahead prefetch",
                self.prefetcher.chunks if self.prefetcher else 0,
                None,
            ),
            (
                "hcache_saver_stalls",
                "Times the saver waited for room in the host pool",
                tier.get("saver_stalls", 0),
                None,
            ),
            (
                "hcache_saver_stall_seconds",
                "Seconds the saver waited for room in the host pool",
                tier.get("saver_stall_seconds", 0.0),
                None,
            ),
            (
                "hcache_loader_stalls",
                "Times a chunk load (a restore's or a prefetch's) waited for room in the host pool",
                tier.get("loader_stalls", 0),
                None,
            ),
            (
                "hcache_loader_stall_seconds",
                "Seconds chunk loads waited for room in the host pool",
                tier.get("loader_stall_seconds", 0.0),
                None,
            ),
            (
                "hcache_gpu_cache_hit_tokens",
                "Tokens looked up and adopted from the GPU prefix cache",
                cache.hit_tokens if cache else 0,
                None,
            ),
            (
                "hcache_gpu_cache_miss_tokens",
                "Tokens looked up and not in the GPU prefix cache",
                cache.miss_tokens if cache else 0,
                None,
            ),
            (
                "hcache_gpu_cache_evictions",
                "Entries evicted from the GPU prefix cache",
                cache.evictions if cache else 0,
                None,
            ),
        ]
        for name, doc, value, label in counters:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            for key, v in value.items() if label else [(None, value)]:
                family.add_metric([key] if label else [], v)
            yield family
        disabled = GaugeMetricFamily(
            "hcache_self_check_disabled",
            "1 for a restore method the start-up self-check "
            "disabled for this process (it did not match recompute), else 0",
            labels=["method"],
        )
        for method in (Method.H.value, Method.KV.value):
            disabled.add_metric([method], int(method in self.self_check_disabled))
        yield disabled
        blocks = GaugeMetricFamily("hcache_gpu_cache_blocks", "KV blocks the GPU prefix cache holds")
        blocks.add_metric([], cache.blocks if cache else 0)
        yield blocks

    def snapshot(self) -> dict[str, float]:
        """Every sample now, by name, with labels as Prometheus writes them: ``name{label="value"}``."""
        out = {}
        for family in self.registry.collect():
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out


def serve_metrics(metrics: ServingMetrics, port: int, host: str = "localhost"):
    """Expose ``metrics`` for Prometheus at ``http://host:port/metrics`` from a daemon thread."""
    return start_http_server(port, addr=host, registry=metrics.registry)
