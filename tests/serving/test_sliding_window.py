"""Jenga's rule per layer type in hcache's own engine: sliding-window layers store and restore only their
last window, full-attention layers everything, and a restore equals recompute by every method."""

import json

import pytest
import torch
from support.helpers import random_prompt
from test_restore import assert_restored_kv_equals_recompute, plans

from hcache.cli import main
from hcache.errors import UnsupportedModelError
from hcache.model.loader import LoadedModel
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.window import WindowRule
from hcache.resolve import resolve
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key

WINDOW = 80  # more than a chunk, not a multiple of one

# Gemma-2/3's shape: sliding layers with a full-attention layer between (on Qwen2, whose layer_types
# transformers and vLLM honour per layer); and Mistral's, one window on every layer.
SHAPES = {
    "alternating": (
        "qwen2",
        dict(
            num_hidden_layers=4,
            max_position_embeddings=1024,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "uniform": ("mistral", dict(num_hidden_layers=3, max_position_embeddings=1024, sliding_window=WINDOW)),
}


# Mistral's one window on every layer is the alternating shape's rule on each layer: the whole suite's.
@pytest.fixture(params=["alternating", pytest.param("uniform", marks=pytest.mark.slow)], scope="module")
def windowed(request) -> LoadedModel:
    family, overrides = SHAPES[request.param]
    model = random_model(family, **overrides)
    return LoadedModel(
        f"random:{family}-{request.param}", model, ModelSpec.from_config(model.config, torch.float32), None
    )


def test_the_rule_in_chunks():
    model = random_model("qwen2", **SHAPES["alternating"][1])
    spec = ModelSpec.from_config(model.config, torch.float32)
    window = WindowRule(spec)
    assert [spec.layer_type(layer) for layer in range(4)] == [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert window.sliding_layers == [0, 1, 3]
    # A restore of 400 tokens reads a sliding layer from position 320 on: chunk 5; a full layer from chunk 0.
    assert window.first_read(0, 400) == 5 and window.first_read(2, 400) == 0
    assert window.first_read(0, WINDOW) == 0
    # A save up to 400 keeps what a restore ending anywhere in [336, 400] reads: chunks 4 on.
    assert [c for c in range(7) if window.saves(0, c, 400)] == [4, 5, 6]
    assert all(window.saves(2, c, 400) for c in range(7))
    assert window.read_tokens(0, 0, 400) == 400 - 5 * CHUNK_TOKENS and window.read_tokens(2, 0, 400) == 400
    # An engine of 128-token blocks holds the window from the block of position 320: chunk 4.
    assert WindowRule(spec, block=128).first_read(0, 400) == 4
    # sliding_layers="all": every token, as full attention.
    every = WindowRule(spec, every_token=True)
    assert (
        every.sliding_layers == [] and every.first_read(0, 400) == 0 and all(every.saves(0, c, 400) for c in range(7))
    )


def test_every_method_restores_histories_past_the_window(windowed, tmp_path, rng):
    """Histories of 2x, 4x and 5x the window, restored by every method and mixed plan: the K/V every layer
    attends equals recompute's, and the greedy tokens are recompute's."""
    spec = windowed.spec
    runtime = HCacheRuntime(windowed, tmp_path, save="all")
    prompt = random_prompt(2 * WINDOW + 30, spec.vocab_size, rng)
    first = runtime.generate(prompt, 3 * WINDOW, restore=False, stop_token_ids=set())
    history = prompt + first.output_ids[:-1]
    every = plans(spec.num_layers)
    for length, methods in (
        (2 * WINDOW + 20, every[:3]),
        (4 * WINDOW + 10, every[:3]),
        (len(history), every),
    ):  # a reply regenerated, then the returning turn
        follow_up = history[:length] + random_prompt(9, spec.vocab_size, rng)
        expected = runtime.generate(follow_up, 10, restore=False).output_ids
        for text in methods:
            plan = runtime.resolve_plan(text)
            restored = assert_restored_kv_equals_recompute(runtime, follow_up, plan)
            assert restored == (length // CHUNK_TOKENS) * CHUNK_TOKENS
            result = runtime.generate(follow_up, 10, plan=plan)
            assert result.output_ids == expected, f"plan {plan} at {length} tokens"
            assert (
                result.restored_tokens == restored
                and result.fallback is None
                and set(result.miss_tokens) <= {"plan_recompute"}
            )


def test_sliding_layers_store_and_read_their_window_only(windowed, tmp_path, rng, capsys):
    spec = windowed.spec
    runtime = HCacheRuntime(windowed, tmp_path, save="plan", plan="KV")
    window = runtime.stack.window  # by the reference engine's 64-token blocks
    sliding = window.sliding_layers
    prompt = random_prompt(8 * CHUNK_TOKENS + 5, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    runtime.store.flush()
    keys = chunk_keys(prompt, root_key(runtime.fingerprint))
    kept = []
    for key in keys:
        image = runtime.store.fetch(key).result()
        try:
            kept.append({layer for layer in range(spec.num_layers) if image.has(layer, "KV")})
        finally:
            runtime.store.release(image)
    for index, layers in enumerate(kept):
        assert layers == {layer for layer in range(spec.num_layers) if window.saves(layer, index, len(prompt))}, (
            f"chunk {index}"
        )
        assert set(range(spec.num_layers)) - set(sliding) <= layers  # full attention: every chunk
    assert not kept[0] & set(sliding) and set(sliding) <= kept[-1]  # far behind the window, and in it
    assert main(["store", "inspect", str(tmp_path), "--json"]) == 0  # beside the live store, read-only
    layers = json.loads(capsys.readouterr().out)["layers"]
    chunks = len(keys)
    assert {int(layer): n for layer, n in layers.items()} == {
        layer: chunks if layer not in sliding else sum(window.saves(layer, c, len(prompt)) for c in range(chunks))
        for layer in range(spec.num_layers)
    }

    # The returning turn reads a sliding layer's window, a full layer everything: the bytes say so.
    result = runtime.generate(prompt + random_prompt(3, spec.vocab_size, rng), 2, plan="KV")
    assert result.restored_tokens == 8 * CHUNK_TOKENS
    per_chunk = CHUNK_TOKENS * spec.kv_bytes_per_token_layer
    full = spec.num_layers - len(sliding)
    assert result.type_bytes.get("full_attention", 0) == full * 8 * per_chunk
    reads = window.first_read(sliding[0], 8 * CHUNK_TOKENS)
    assert result.type_bytes["sliding_attention"] == len(sliding) * (8 - reads) * per_chunk
    assert result.bytes_read == sum(result.type_bytes.values())


def test_a_branch_behind_the_window_restores_what_it_can(windowed, tmp_path, rng):
    """A conversation that branches from a saved one far before its end finds its sliding layers' window
    not kept there: it restores a shorter prefix, or none, says why, and answers as recompute does."""
    spec = windowed.spec
    runtime = HCacheRuntime(windowed, tmp_path, save="all")
    prompt = random_prompt(10 * CHUNK_TOKENS, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    branch = prompt[: 3 * CHUNK_TOKENS] + random_prompt(20, spec.vocab_size, rng)
    expected = (
        HCacheRuntime(windowed, tmp_path / "plain", save="none").generate(branch, 8, restore=False).output_ids
    )  # saves nothing
    result = runtime.generate(branch, 8)
    assert result.output_ids == expected
    assert result.restored_tokens < 3 * CHUNK_TOKENS
    assert result.miss_tokens == {"outside_window": 3 * CHUNK_TOKENS - result.restored_tokens}


def test_sliding_layers_all_restores_a_branch_behind_the_window(windowed, tmp_path, rng):
    """``sliding_layers="all"``: every token stored and restored, as full attention; a branch far back
    restores whole, and a restore reads every chunk of every layer."""
    spec = windowed.spec
    runtime = HCacheRuntime(windowed, tmp_path, save="plan", plan="KV", sliding_layers="all")
    prompt = random_prompt(10 * CHUNK_TOKENS, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    branch = prompt[: 3 * CHUNK_TOKENS] + random_prompt(20, spec.vocab_size, rng)
    expected = HCacheRuntime(windowed, tmp_path / "plain", save="none").generate(branch, 8, restore=False).output_ids
    result = runtime.generate(branch, 8)
    assert result.output_ids == expected and result.restored_tokens == 3 * CHUNK_TOKENS and not result.miss_tokens
    assert result.bytes_read == spec.num_layers * 3 * CHUNK_TOKENS * spec.kv_bytes_per_token_layer


def test_a_windowed_sequence_leaves_nothing_to_the_gpu_prefix_cache(windowed, tmp_path, rng):
    """Its blocks hold no sliding-window rows before its window: a shorter prefix of them would attend
    rows never written, so they are freed, not kept."""
    spec = windowed.spec
    runtime = HCacheRuntime(windowed, tmp_path, save="plan", plan="KV", gpu_cache=True, num_blocks=64)
    prompt = random_prompt(6 * CHUNK_TOKENS, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    runtime.stack.gpu_cache.clear()
    resent = prompt + random_prompt(4, spec.vocab_size, rng)
    assert runtime.generate(resent, 1).restored_tokens == 6 * CHUNK_TOKENS  # from the store, windowed
    assert runtime.stack.gpu_cache.blocks == 0
    shorter = prompt[: 2 * CHUNK_TOKENS] + random_prompt(4, spec.vocab_size, rng)
    expected = HCacheRuntime(windowed, tmp_path / "plain", save="none").generate(shorter, 6, restore=False).output_ids
    result = runtime.generate(shorter, 6)
    assert result.output_ids == expected and result.gpu_tokens == 0


def test_the_deepspeed_paths_tensor_parallelism_refuses_the_window_rule():
    model = random_model("mistral", sliding_window=WINDOW)
    spec = ModelSpec.from_config(model.config, torch.float32)
    with pytest.raises(UnsupportedModelError, match="sliding-window layers cannot be served with tensor parallelism"):
        resolve({"save": "plan", "plan": "KV", "engine": "reference"}, spec, "random:mistral", tensor_parallel=2)
    resolve(
        {"save": "plan", "plan": "KV", "engine": "reference", "sliding_layers": "all"},
        spec,
        "random:mistral",
        tensor_parallel=2,
    )
    # FastGen windows no layer (its Mistral attends to every position): the rule is off there.
    fastgen = resolve({"save": "plan", "plan": "KV"}, spec, "random:mistral", tensor_parallel=2, engine="fastgen")
    assert fastgen.window_rule(spec).sliding_layers == [] and WindowRule(spec).sliding_layers == [0, 1, 2]
    resolve(
        {"save": "plan", "plan": "KV"}, spec, "random:mistral", tensor_parallel=2, engine="vllm"
    )  # vLLM's ranks load KV only


def test_the_reference_engine_windows_as_transformers_does(windowed, rng):
    """Past the window, prefill and decode logits equal transformers' forward of the same model."""
    from hcache.engine.reference import ReferenceEngine

    ids = random_prompt(3 * WINDOW + 10, windowed.spec.vocab_size, rng)
    with torch.no_grad():
        expected = windowed.model(torch.tensor([ids])).logits[0]
    engine = ReferenceEngine(windowed.model, windowed.spec, num_blocks=16)
    torch.testing.assert_close(engine.step([(0, ids[:-20])])[0], expected[-21], atol=1e-4, rtol=0)
    for i in range(len(ids) - 20, len(ids)):
        torch.testing.assert_close(engine.step([(0, [ids[i]])])[0], expected[i], atol=1e-4, rtol=0)
