"""Tensor-parallel restore on the CPU: two gloo processes against a TP=1 reference in this process.

The two ranks run every scenario in one spawn (process start-up dominates on a small CPU) and save what
they saw; each test checks one part of it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.helpers import corrupt_tensor, loaded, random_prompt

from hcache.engine.reference import ReferenceEngine
from hcache.errors import UnsupportedModelError
from hcache.model.loader import LoadedModel
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.plan import Method, RestorePlan
from hcache.planning.profile import Profile, ProfileMismatch
from hcache.planning.profiler import measure_profile
from hcache.serving.restore import restore_prefix
from hcache.serving.runtime import HCacheRuntime
from hcache.planning.scheduler import LayerCosts, partition
from hcache.storage.chunk import ChunkImage
from hcache.storage.chunk_key import chunk_keys, root_key
from hcache.model.tensor_parallel import TPGroup, local_spec, shard_model

TP = 2
LAYERS = 4
PLANS = ["RE", "H", "KV", "1RE+2H+1KV"]
PROMPT = 200  # 3 full chunks: rank 0 stores the hidden states of chunks 0 and 2, rank 1 those of chunk 1
RESTORED = 192
NEW_TOKENS = 8
KV_ATOL = 1e-5
OTHER_FAMILIES = ("mistral", "qwen2", "opt")


def _model() -> LoadedModel:
    model = random_model("llama", num_hidden_layers=LAYERS)  # 4 heads, 4 KV heads, D = 64; seed 0 everywhere
    return LoadedModel("random:llama", model, ModelSpec.from_config(model.config, torch.float32), None)


def _kv(engine, uid: int) -> list[torch.Tensor]:
    return [torch.stack(engine.kv(uid, layer)) for layer in range(LAYERS)]  # [2, T, heads, head_size] per layer


class _ReadLog:
    """Records, in this process, every stored tensor a restore copies out of the host pool."""

    def __init__(self):
        self.tensors = []
        tensor = ChunkImage.tensor

        def logged(image, layer, fmt):
            self.tensors.append((image.key, layer, fmt))
            return tensor(image, layer, fmt)

        ChunkImage.tensor = logged

    def take(self) -> list:
        """What was read since the last call."""
        got, self.tensors = self.tensors, []
        return got


def _rank(rank: int, out, prompt: list[int]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=TP)
    torch.set_num_threads(1)
    tp = TPGroup.current()
    # Chunks are loaded from disk by 2 reader threads when they are not in the host pool.
    runtime = HCacheRuntime(
        _model(), out / f"store{rank}", plan="H", save="all", num_blocks=16, readers=2, tensor_parallel=tp
    )
    engine, copier = runtime.engine, runtime.stack.copier
    seen = {"cache_heads": engine.cache.layers[0].shape[3]}
    seen["logits"] = engine.step([(0, prompt)]).clone()
    engine.flush(0)
    for family in OTHER_FAMILIES:  # QKV biases, GQA, sliding windows, OPT's biased row-parallel linears
        lm = loaded(f"random:{family}")
        seen[family] = ReferenceEngine(*shard_model(lm.model, lm.spec, tp)).step([(0, prompt)])
    seen["reference"] = runtime.generate(prompt, NEW_TOKENS, restore=False).output_ids  # saves 3 chunks
    keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
    log = _ReadLog()
    for plan in PLANS:
        log.take()  # forget the reads of the last generate
        outcome = restore_prefix(
            engine, runtime.store, 1, prompt, keys, runtime.fingerprint, RestorePlan.parse(plan, LAYERS), copier, tp
        )
        seen[plan] = dict(tokens=outcome.tokens, fallback=outcome.fallback, kv=_kv(engine, 1), tensors=log.take())
        seen[plan]["tensor_bytes"] = outcome.bytes_read
        engine.flush(1)
        seen[plan]["output"] = runtime.generate(prompt, NEW_TOKENS, plan=plan).output_ids
    # In two steps, as a prompt arrives in parts: chunk 0, then chunks 1 and 2 (rank 1 stores chunk 1's H).
    plan = RestorePlan.parse("1RE+2H+1KV", LAYERS)
    steps = [restore_prefix(engine, runtime.store, 1, prompt, keys[:1], runtime.fingerprint, plan, copier, tp)]
    steps.append(restore_prefix(engine, runtime.store, 1, prompt[64:], keys[1:], runtime.fingerprint, plan, copier, tp))
    seen["steps"] = dict(tokens=[o.tokens for o in steps], fallbacks=[o.fallback for o in steps], kv=_kv(engine, 1))
    engine.flush(1)
    # As MII sends it, in puts of 100: the second restore starts inside chunk 1, at token 100.
    runtime.serving.put([60], [prompt[:100]])
    logits = runtime.serving.put([60], [prompt[100:]])
    record = runtime.serving.record(60)
    seen["split"] = dict(tokens=record.restored_tokens, fallback=record.fallback, kv=_kv(engine, 60), logits=logits)
    runtime.serving.flush(60)
    # A corrupt hidden-state tensor in rank 0's chunk 2, found while reading layer 1.
    if rank == 0:
        corrupt_tensor(runtime.store, keys[2], 1, "H")
    dist.barrier()
    result = runtime.generate(prompt, NEW_TOKENS, plan="H")
    seen["corrupt"] = dict(
        tokens=result.restored_tokens, fallback=result.fallback, output=result.output_ids, misses=result.miss_tokens
    )
    # Rank 1's chunk 1 was found bad and discarded (by another request): its look-up ends before any layer is read.
    if rank == 1:
        runtime.store.discard(keys[1])
    dist.barrier()
    result = runtime.generate(prompt, NEW_TOKENS, plan="KV")
    seen["missing"] = dict(
        tokens=result.restored_tokens, fallback=result.fallback, output=result.output_ids, misses=result.miss_tokens
    )
    seen["miss_counters"] = {
        k: v for k, v in runtime.metrics.snapshot().items() if k.startswith("hcache_miss_tokens_total") and v
    }
    runtime.close()
    # Saving only what an H plan needs: a rank's chunks without hidden states hold no tensor at all.
    runtime = HCacheRuntime(_model(), out / f"plan{rank}", plan="H", num_blocks=16, readers=2, tensor_parallel=tp)
    runtime.generate(prompt, 1, restore=False)
    keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
    tensors = []
    for key in keys:
        image = runtime.store.fetch(key).result()
        tensors.append(len(image.layout.entries))
        runtime.store.release(image)
    result = runtime.generate(prompt, NEW_TOKENS)
    seen["plan_only"] = dict(tensors=tensors, tokens=result.restored_tokens, output=result.output_ids)
    runtime.close()
    seen["profile"] = measure_profile(_model(), [64, 256], repeats=1, readers=0, tp=tp)
    torch.save(seen, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(what each rank saw, the TP=1 reference)."""
    out = tmp_path_factory.mktemp("tp")
    prompt = random_prompt(PROMPT, 256, torch.Generator().manual_seed(1))
    mp.spawn(_rank, args=(out, prompt), nprocs=TP)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(TP)]  # written by this test

    lm = _model()
    ref = {
        family: ReferenceEngine(loaded(f"random:{family}").model, loaded(f"random:{family}").spec).step([(0, prompt)])
        for family in OTHER_FAMILIES
    }
    with HCacheRuntime(lm, out / "tp1", save="all") as runtime:
        ref["logits"] = runtime.engine.step([(0, prompt)]).clone()
        runtime.engine.flush(0)
        ref["reference"] = runtime.generate(prompt, NEW_TOKENS, restore=False).output_ids
        runtime.engine.step([(2, prompt[:RESTORED])])
        ref["recompute"] = _kv(runtime.engine, 2)
        keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
        for plan in PLANS:
            plan_ = RestorePlan.parse(plan, LAYERS)
            outcome = restore_prefix(
                runtime.engine, runtime.store, 1, prompt, keys, runtime.fingerprint, plan_, runtime.stack.copier
            )
            assert outcome.tokens == RESTORED
            ref[plan] = _kv(runtime.engine, 1)
            runtime.engine.flush(1)
    return ranks, ref, lm.spec


@pytest.mark.slow
def test_sharded_forward_equals_tp1(runs):
    ranks, ref, spec = runs
    for rank in ranks:
        assert rank["cache_heads"] == spec.num_kv_heads // TP  # each rank caches only its KV heads
        for name in ("logits", *OTHER_FAMILIES):
            torch.testing.assert_close(rank[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert rank["reference"] == ref["reference"]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.slow
def test_restored_kv_is_the_rank_head_slice_of_tp1(runs, plan):
    ranks, ref, spec = runs
    heads = spec.num_kv_heads // TP
    for r, rank in enumerate(ranks):
        got = rank[plan]
        assert got["tokens"] == RESTORED and got["fallback"] is None
        for layer in range(LAYERS):
            mine = slice(r * heads, (r + 1) * heads)
            for want in (ref[plan][layer], ref["recompute"][layer]):
                torch.testing.assert_close(got["kv"][layer], want[:, :, mine], atol=KV_ATOL, rtol=0)
        assert got["output"] == ref["reference"], f"rank {r}, plan {plan}"


@pytest.mark.slow
def test_restore_in_steps(runs):
    ranks, ref, spec = runs
    heads = spec.num_kv_heads // TP
    for r, rank in enumerate(ranks):
        assert rank["steps"]["tokens"] == [64, 128] and rank["steps"]["fallbacks"] == [None, None]
        for got, want in zip(rank["steps"]["kv"], ref["recompute"]):
            torch.testing.assert_close(got, want[:, :, r * heads : (r + 1) * heads], atol=KV_ATOL, rtol=0)


@pytest.mark.slow
def test_restore_from_inside_a_chunk(runs):
    """Through the serving engine in puts of 100 tokens, by the H plan: 64 tokens, then 92 from the middle of
    chunk 1 (whose hidden states rank 1 holds); each rank's K/V is its slice of TP=1's, the logits TP=1's."""
    ranks, ref, spec = runs
    heads = spec.num_kv_heads // TP
    for r, rank in enumerate(ranks):
        assert rank["split"]["tokens"] == 64 + 92 and rank["split"]["fallback"] is None
        for got, want in zip(rank["split"]["kv"], ref["recompute"]):
            torch.testing.assert_close(got[:, :RESTORED], want[:, :, r * heads : (r + 1) * heads], atol=KV_ATOL, rtol=0)
        torch.testing.assert_close(rank["split"]["logits"], ref["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.slow
def test_each_stored_byte_is_read_once(runs, plan):
    ranks, _, spec = runs
    parsed = RestorePlan.parse(plan, LAYERS)
    h_layers, kv_layers = parsed.count(Method.H), parsed.count(Method.KV)
    need = RESTORED * (h_layers * spec.hidden_bytes_per_token_layer + kv_layers * spec.kv_bytes_per_token_layer)
    assert sum(rank[plan]["tensor_bytes"] for rank in ranks) == need
    reads = [rank[plan]["tensors"] for rank in ranks]
    for tensors in reads:
        assert len(tensors) == len(set(tensors))  # no tensor read twice by a rank
    assert not {key for key, *_ in reads[0]} & {key for key, *_ in reads[1]}  # each rank reads only its own chunks
    if h_layers:  # hidden states: rank 0 reads chunks 0 and 2, rank 1 chunk 1, of each H layer
        assert [sum(fmt == "H" for *_, fmt in tensors) for tensors in reads] == [2 * h_layers, h_layers]


@pytest.mark.slow
def test_bad_chunk_on_one_rank_ends_the_prefix_on_all(runs):
    ranks, ref, _ = runs
    corrupt, missing = [r["corrupt"] for r in ranks], [r["missing"] for r in ranks]
    assert [c["tokens"] for c in corrupt] == [128, 128]
    assert "checksum" in corrupt[0]["fallback"] and "another tensor-parallel rank" in corrupt[1]["fallback"]
    assert [m["tokens"] for m in missing] == [64, 64]
    assert "another tensor-parallel rank" in missing[0]["fallback"] and missing[1]["fallback"] is None
    # miss reasons: the rank whose chunk failed says why; the other, that another rank's prefix ended first
    assert [c["misses"] for c in corrupt] == [{"failed_verification": 64}, {"other_rank": 64}]
    assert [m["misses"] for m in missing] == [{"other_rank": 128}, {"failed_verification": 128}]
    counted = [
        {
            reason: r["miss_counters"].get(f'hcache_miss_tokens_total{{reason="{reason}"}}', 0)
            for reason in ("failed_verification", "never_stored", "other_rank")
        }
        for r in ranks
    ]
    assert counted == [
        {"failed_verification": 64, "never_stored": 0, "other_rank": 128},
        {"failed_verification": 128, "never_stored": 0, "other_rank": 64},
    ]
    for case in (*corrupt, *missing):
        assert case["output"] == ref["reference"]


@pytest.mark.slow
def test_saving_for_an_h_plan_stores_each_chunk_hidden_states_once(runs):
    ranks, ref, _ = runs
    assert [rank["plan_only"]["tensors"] for rank in ranks] == [[LAYERS, 0, LAYERS], [0, LAYERS, 0]]
    for rank in ranks:
        assert rank["plan_only"]["tokens"] == RESTORED and rank["plan_only"]["output"] == ref["reference"]


def test_unsupported_shapes_are_refused():
    with pytest.raises(UnsupportedModelError, match="divide"):
        local_spec(_model().spec, TPGroup(0, 3))
    with pytest.raises(UnsupportedModelError, match="separate q/k/v"):
        local_spec(loaded("random:phi3").spec, TPGroup(0, 2))


@pytest.mark.slow
def test_profile_measures_the_all_gather(runs, tmp_path):
    ranks, _, spec = runs
    for r, rank in enumerate(ranks):
        profile = rank["profile"]
        assert profile.tensor_parallel == TP and profile.model["num_kv_heads"] == spec.num_kv_heads // TP
        assert len(profile.seconds["ag_h"]) == 2 and all(t > 0 for t in profile.seconds["ag_h"])
        assert profile.costs(256).ag_h == profile.seconds["ag_h"][1]
        profile.save(tmp_path / f"rank{r}.json")
        shard = local_spec(spec, TPGroup(r, TP))
        assert Profile.load(tmp_path / f"rank{r}.json", shard, TP).seconds == profile.seconds
        with pytest.raises(ProfileMismatch, match="tensor parallelism 2, not 1"):
            Profile.load(tmp_path / f"rank{r}.json", shard)


def test_scheduler_counts_the_all_gather_on_h_layers():
    base = dict(c_token=10.0, c_h=1.0, c_kv=0.1, io_h=1.0, io_kv=2.0)
    assert str(partition(LayerCosts(**base), 8, 64, 128)) == "8H"  # I/O and compute balance
    slow_gather = LayerCosts(**base, ag_h=2.0)  # H now costs 3 s of compute per layer
    assert slow_gather.plan_time(0, 8, 0) == 24.0
    assert str(partition(slow_gather, 8, 64, 128)) == "4H+4KV"  # max(4·3 + 4·0.1, 4·1 + 4·2) = 12.4 s
