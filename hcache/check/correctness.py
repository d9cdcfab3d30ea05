"""Every restore method against recompute, per model family and engine: a conversation is saved, then
returns; the restored cache must be the one the engine's own forward builds, and the greedy tokens after it
the same, by the rule the start-up self-check uses too (:mod:`hcache.serving.self_check`: K and V within
float rounding on the reference engine, bit for bit on FastGen but for H's K within the bound of its
fast-math RoPE; state stored in 8 bits within ``LOSSY_BOUND`` relative RMS, reported lossy, its tokens free
to differ).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ..engine.reference import ReferenceEngine
from ..engine.interface import Engine
from ..model.fingerprint import model_fingerprint
from ..model.random_weights import random_model
from ..model.spec import ModelSpec
from ..planning.plan import Method
from ..resolve import resolve
from ..serving.engine import ServingEngine
from ..serving.self_check import Comparison, layer_excess, layer_state
from ..serving.store_stack import StoreStack
from ..storage.chunk_key import CHUNK_TOKENS

FAMILIES = {  # config overrides FastGen needs (no sliding window; Phi-3's default RoPE)
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # the reference engine's alone: DeepSpeed's FastGen has neither Qwen3, Gemma nor these hybrids
    "qwen3": {},
    "gemma2": {},
    "gemma3_text": {},
    # a Mamba-2 hybrid: Mamba, attention, Mamba (its heads fill the mixer's width at hidden 256)
    "granitemoehybrid": {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_d_head": 128},
    # a gated-delta-net hybrid: gated delta net, gated attention, gated delta net
    "qwen3_next": {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"]},
}
# The random shapes have 3 layers. "<plan> <stored_dtype>": restored from state stored in that encoding.
PLANS = ("RE", "H", "KV", "1RE+1H+1KV", "H 8bit", "KV 8bit")
NEW_TOKENS = 4


def families_on(kind: str) -> tuple[str, ...]:
    """The families the check runs on engine ``kind``: on FastGen, those hcache's adapter serves."""
    from ..engine.fastgen import SUPPORTED_MODEL_TYPES

    return tuple(f for f in FAMILIES if kind != "fastgen" or f in SUPPORTED_MODEL_TYPES)


def check_restores(engines: list[str], families: tuple[str, ...] | None = None, progress=None) -> list[dict]:
    """One case per engine, family (by default, :func:`families_on` the engine) and plan; each says whether
    it passed and by how much. A family that cannot run (its engine fails to build, say) fails its
    remaining plans with the error, and the others still run."""
    cases = []
    for kind in engines:
        for family in families_on(kind) if families is None else families:
            done = set()
            try:
                for case in _family(kind, family):
                    cases.append(case)
                    done.add(case["plan"])
                    if progress is not None:
                        progress(case)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                for plan in (p for p in PLANS if p not in done):
                    cases.append({"engine": kind, "family": family, "plan": plan, "error": error, "ok": False})
                    if progress is not None:
                        progress(cases[-1])
    return cases


def _family(kind: str, family: str) -> Iterator[dict]:
    with tempfile.TemporaryDirectory(prefix="hcache-check-") as tmp:
        engine, fingerprint = _engine(kind, family, Path(tmp))
        # FastGen runs a forward in batches of up to 768 tokens: one put holds the saved history.
        history_tokens = 720 if kind == "fastgen" else 3 * CHUNK_TOKENS + 8
        returning = history_tokens // CHUNK_TOKENS * CHUNK_TOKENS  # the restore ends inside its last chunk
        spec = engine.spec
        history = torch.randint(
            0, spec.vocab_size, (history_tokens,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        for i, case in enumerate(PLANS):
            plan, _, stored_dtype = case.partition(" ")
            settings = {
                "store_dirs": [f"{tmp}/{i}"],
                "save": "all",
                "readers": 0,
                "plan": plan,
                "stored_dtype": stored_dtype or "auto",
            }
            config = resolve(settings, spec, f"random:{family}")
            with ServingEngine(engine, StoreStack(config, engine, fingerprint)) as serving:
                saved, reference, restored = 10 * i + 1, 10 * i + 2, 10 * i + 3
                serving.put([saved], [history])
                serving.flush(saved)
                serving.open(reference, restore=False)
                want = _greedy(serving, reference, serving.put([reference], [history[:returning]]))
                got = _greedy(serving, restored, serving.put([restored], [history[:returning]]))
                record = serving.record(restored)
                n = returning - 1  # a hybrid's restore ends at its last kept state, a chunk's end, unless it is RE's
                if any(spec.is_recurrent(layer) and m is not Method.RE for layer, m in enumerate(config.plan.layers)):
                    n -= n % (CHUNK_TOKENS * config.settings.state_every)
                errors = tuple(
                    layer_excess(
                        kind,
                        m,
                        layer_state(engine, restored, layer, n),
                        layer_state(engine, reference, layer, n),
                        spec,
                        bool(stored_dtype),
                    )
                    for layer, m in enumerate(config.plan.layers)
                )
                serving.flush(restored)
                serving.flush(reference)
            c = Comparison(
                record.restored_tokens, n, record.fallback, got == want, record.lossy, bool(stored_dtype), errors
            )
            yield {
                "engine": kind,
                "family": family,
                "dtype": spec.dtype,
                "plan": case,
                "restored_tokens": c.restored_tokens,
                "expected_tokens": n,
                "fallback": c.fallback,
                "tokens_equal": c.tokens_equal,
                "lossy": c.lossy,
                "worst_excess": c.worst_excess,
                "ok": c.ok,
            }
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _engine(kind: str, family: str, tmp: Path) -> tuple[Engine, str]:
    gpu = torch.cuda.is_available()
    dtype = torch.float16 if gpu else torch.float32
    shape = dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=2048,
    )
    model = random_model(family, dtype, device="cuda" if gpu else "cpu", **shape, **FAMILIES[family])
    if kind == "reference":
        spec = ModelSpec.from_config(model.config, dtype)
        return ReferenceEngine(model, spec, num_blocks=64), model_fingerprint(model, spec)
    from ..engine.fastgen import build_fastgen_engine
    from ..model.fingerprint import checkpoint_fingerprint

    model.save_pretrained(tmp / "model")
    del model
    torch.cuda.empty_cache()
    engine = build_fastgen_engine(
        str(tmp / "model"), {"state_manager": {"memory_config": {"mode": "allocate", "size": 512}}}
    )
    return engine, checkpoint_fingerprint(str(tmp / "model"), engine.spec)


def _greedy(serving: ServingEngine, uid: int, logits: torch.Tensor) -> list[int]:
    out = [int(logits[-1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        out.append(int(serving.put([uid], [[out[-1]]])[-1].argmax()))
    return out
