"""Restores through the runtime from chunks saved in 8 bits (``stored_dtype``): close to lossless and marked
lossy, mixed with lossless chunks on either runtime, a corrupt scale recomputed, and GPU-cache blocks of a
sequence that restored 8-bit state lossy for every adopter."""

import pytest
import torch
from support.helpers import corrupt_tensor, loaded, random_prompt

from hcache.serving.runtime import HCacheRuntime


@pytest.fixture(scope="module")
def llama():
    return loaded("random:llama")


def _runtime(model, store, **settings):
    return HCacheRuntime(model, store, save="all", **settings)


@pytest.mark.parametrize("stored_dtype, plan", [("8bit", "H"), ("8bit", "KV"), ("int8", "1RE+1H+1KV"), ("fp8", "H")])
def test_restore_from_compressed_chunks_is_close_to_lossless_and_says_so(llama, tmp_path, rng, stored_dtype, plan):
    prompt = random_prompt(200, llama.spec.vocab_size, rng)
    with (
        _runtime(llama, tmp_path / "lossless", plan=plan) as exact,
        _runtime(llama, tmp_path / "q", plan=plan, stored_dtype=stored_dtype) as lossy,
    ):
        exact.generate(prompt, 1)
        lossy.generate(prompt, 1)
        exact.store.flush(), lossy.store.flush()
        assert lossy.store.stores[0].used_bytes <= 0.52 * exact.store.stores[0].used_bytes
        r_exact, r_lossy = exact.generate(prompt, 1), lossy.generate(prompt, 1)
        assert r_exact.restored_tokens == r_lossy.restored_tokens == 192
        assert not r_exact.lossy and r_lossy.lossy
        assert r_lossy.bytes_read < 0.52 * r_exact.bytes_read
        uid = 10**6
        for rt in (exact, lossy):  # the restored caches, side by side
            rt.serving.open(uid)
            rt.serving.put([uid], [prompt[:193]])
        errors = []
        for layer in range(llama.spec.num_layers):
            k0, v0 = exact.engine.kv(uid, layer)
            k1, v1 = lossy.engine.kv(uid, layer)
            for a, b in ((k0, k1), (v0, v1)):
                assert not torch.equal(a, b) or plan.startswith("1RE") and layer == 0
                errors.append(((a - b).norm() / a.norm()).item())
    print(f"{stored_dtype} {plan}: relative RMS error of K and V per layer {[round(e, 4) for e in errors]}")
    # fp8 keeps 3 mantissa bits (a relative step of 1/8 at most, an RMS error near 2%); int8 per-row steps
    # are finer for KV. The projection of H sums those errors over the hidden size without raising them.
    assert max(errors) <= 0.05


def test_chunks_saved_lossless_and_compressed_restore_on_either_runtime(llama, tmp_path, rng):
    """One store, written by a lossless runtime and then, for the conversation's next turn, by a compressed
    one: a restore spans both kinds of chunk, on either runtime, and a lossless restore stays bit-exact."""
    first = random_prompt(140, llama.spec.vocab_size, rng)
    turn = first + random_prompt(130, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path / "scratch", plan="H") as exact:
        want = exact.generate(turn, 1).output_ids
    with _runtime(llama, tmp_path, plan="H") as exact:
        exact.generate(first, 1)
    with _runtime(llama, tmp_path, plan="H", stored_dtype="fp8") as lossy:
        r = lossy.generate(turn, 1)  # restores the 2 lossless chunks, saves the next 2 compressed
        assert r.restored_tokens == 128 and not r.lossy and r.output_ids == want
    with _runtime(llama, tmp_path, plan="H") as exact:
        r = exact.generate(turn, 1)
        assert r.restored_tokens == 256 and r.lossy
        uid = 10**6
        exact.serving.open(uid)
        exact.serving.put([uid], [turn[:257]])
        k_mixed, _ = exact.engine.kv(uid, 1)
        exact.serving.flush(uid)
        exact.serving.open(uid, restore=False)
        exact.serving.put([uid], [turn[:257]])
        k_exact, _ = exact.engine.kv(uid, 1)
        assert torch.equal(k_mixed[:128], k_exact[:128])  # the lossless chunks: bit-exact
        assert not torch.equal(k_mixed[128:256], k_exact[128:256])
        assert (k_mixed - k_exact).norm() <= 0.05 * k_exact.norm()  # fp8 H: an RMS error near 2.5%


def test_state_adopted_from_the_gpu_cache_is_lossy_when_its_sequence_restored_8_bit_state(llama, tmp_path, rng):
    """The GPU prefix cache keeps a sequence's blocks as they are: rows dequantised from 8-bit chunks (and
    rows computed after them) stay lossy for every later adopter."""
    prompt = random_prompt(200, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path, plan="KV", stored_dtype="int8", gpu_cache=True) as rt:
        rt.generate(prompt, 1)  # computed: its kept blocks are exact
        r = rt.generate(prompt, 1)
        assert r.gpu_tokens == r.restored_tokens > 0 and not r.lossy
        rt.drop_device_cache()
        r = rt.generate(prompt, 1)  # restored from the 8-bit chunks, then kept
        assert r.gpu_tokens == 0 and r.restored_tokens > 0 and r.lossy
        r = rt.generate(prompt, 1)
        assert r.gpu_tokens == r.restored_tokens > 0 and r.lossy


def test_a_corrupt_scale_falls_back_to_recompute(llama, tmp_path, rng):
    prompt = random_prompt(140, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path, plan="KV", stored_dtype="int8") as rt:
        rt.generate(prompt, 1)
        keys = list(rt.store.keys())
        corrupt_tensor(rt.store, sorted(keys)[0], 1, "KV.scale")
        r = rt.generate(prompt, 1)
        assert "checksum mismatch" in (r.fallback or "")
        assert r.restored_tokens in (0, 64)  # the chunks before the bad one restore; it is recomputed, and saved again
        assert rt.generate(prompt, 1).restored_tokens == 128
