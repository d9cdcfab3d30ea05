"""The servers a trace is replayed against, one view of both: hcache's runtime, and DeepSpeed-MII's own
``mii.pipeline`` (with hcache's backend, or plain), one call per request."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path
from typing import Protocol

import numpy as np

from ..machine.ports import free_port
from ..restore.records import RestoreStep, SequenceRecord
from ..serving.runtime import HCacheRuntime, RequestResult


class Server(Protocol):
    """What a replay asks of a server: a reply (``generate``), a look-ahead read (``prefetch``), and its
    ``store`` and ``gpu_cache`` (None where it has none), read after it is closed."""

    store: object
    gpu_cache: object

    def generate(self, prompt: list[int], max_new_tokens: int) -> RequestResult: ...

    def prefetch(self, prompt: list[int]) -> int: ...


class RuntimeServer:
    """An :class:`HCacheRuntime`; ``restore=False``: its histories are prefilled whole."""

    def __init__(self, runtime: HCacheRuntime, restore: bool = True):
        self.runtime, self.restore = runtime, restore
        self.prefetch, self.store, self.gpu_cache = runtime.prefetch, runtime.store, runtime.gpu_cache

    def generate(self, prompt: list[int], max_new_tokens: int) -> RequestResult:
        return self.runtime.generate(prompt, max_new_tokens, restore=self.restore, stop_token_ids=())

    def __enter__(self) -> "RuntimeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.close()


def pipeline_on_free_port(model_dir: str, hcache_config: dict | None, **mii_options):
    """``hcache.mii.pipeline``, or plain ``mii.pipeline`` for ``None``, on a free ZMQ port, with MII's
    ``mii_options``."""
    import mii

    import hcache.mii

    port = free_port()
    if hcache_config is None:
        return mii.pipeline(model_dir, zmq_port_number=port, **mii_options)
    return hcache.mii.pipeline(model_dir, hcache=hcache_config, zmq_port_number=port, **mii_options)


class MiiServer:
    """``hcache.mii.pipeline`` (plain ``mii.pipeline`` for ``config=None``) answering one prompt per call.
    MII takes text and returns whole replies: a prompt is decoded by ``tokenizer`` (whose ids must tokenize
    back to themselves: :func:`whole_word_ids`) and a reply encoded again. The pipeline's batching steps are
    timed: with one sequence running, each of the reply's steps made one of its tokens, the first of them
    ending the prefill (TTFT) and the rest the TBTs. What was restored comes from hcache's request log
    (``config["request_log"]``)."""

    def __init__(self, path: str, tokenizer, config: dict | None, mii_options: dict):
        self.tokenizer, self.config = tokenizer, config
        self.pipe = pipeline_on_free_port(path, config, **mii_options)
        served = self.pipe.inference_engine if config is not None else None
        self.store = served.stack.store if served is not None else None
        self.gpu_cache = served.stack.gpu_cache if served is not None else None
        self.prefetch = served.prefetch if served is not None else (lambda prompt: 0)
        self.steps: list[float] = []
        step = self.pipe.generate

        def timed_step(*a, **kw):
            step(*a, **kw)
            self.steps.append(time.perf_counter())

        self.pipe.generate = timed_step

    def generate(self, prompt: list[int], max_new_tokens: int) -> RequestResult:
        self.steps.clear()
        start = time.perf_counter()
        reply = self.pipe(
            [self.tokenizer.decode(prompt)], max_new_tokens=max_new_tokens, ignore_eos=True, do_sample=False
        )[0]
        if reply.generated_length != max_new_tokens or len(self.steps) < max_new_tokens:
            raise RuntimeError(
                f"MII answered {reply.generated_length} tokens in {len(self.steps)} steps, not {max_new_tokens}"
            )
        times = self.steps[-max_new_tokens:]  # the first ended the prefill
        record = json.loads(Path(self.config["request_log"]).read_text().splitlines()[-1]) if self.config else {}
        cost = {f.name: record[f.name] for f in fields(SequenceRecord) if f.name in record}
        cost["restores"] = [RestoreStep(**step) for step in cost.get("restores", [])]
        return RequestResult(
            output_ids=self.tokenizer.encode(reply.generated_text, add_special_tokens=False),
            prompt_tokens=reply.prompt_length,
            ttft_s=times[0] - start,
            tbt_s=np.diff(times).tolist(),
            **cost,
        )

    def __enter__(self) -> "MiiServer":
        return self

    def __exit__(self, *exc) -> None:
        if self.config is not None:
            self.pipe.inference_engine.close()
        self.pipe.destroy()


def whole_word_ids(tokenizer) -> np.ndarray:
    """Ids of the tokens that are one space-led alphabetic word and tokenize back to themselves alone: a text
    of such words tokenizes to exactly its ids."""
    texts = tokenizer.batch_decode([[t] for t in range(len(tokenizer))])
    ids = [t for t, w in enumerate(texts) if len(w) > 1 and w[0] == " " and w[1:].isascii() and w[1:].isalpha()]
    encoded = tokenizer([texts[t] for t in ids], add_special_tokens=False)["input_ids"]
    return np.array([t for t, e in zip(ids, encoded) if e == [t]])
