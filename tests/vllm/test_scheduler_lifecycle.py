"""The scheduler's side of a stored prefix's lifecycle (hcache/vllm/scheduler.py), with two tensor-parallel
ranks: found, held by every rank's worker, offered as far as the shortest holds, loaded, or let go where no
load follows. The scheduler's side needs neither torch nor vLLM, and neither is used here."""

from types import SimpleNamespace

from hcache.planning.checkpoints import StateRule
from hcache.restore.records import MissReason
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.residency import HOST, Residency
from hcache.vllm.events import Cleared, Group
from hcache.vllm.messages import Pinned, WorkerReport
from hcache.vllm.scheduler import SchedulerSide

RANKS = ["model|tp2.0", "model|tp2.1"]  # each rank's fingerprint, in which its keys are rooted
PROMPT = list(range(3 * CHUNK_TOKENS + 1))  # three full chunks, and the token a load never covers
NOTHING_CACHED = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
NO_BATCH = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=NOTHING_CACHED)


def _scheduler(states: StateRule | None = None, **events) -> SchedulerSide:
    """Both ranks' workers have reported holding the prompt's three chunks; no store is asked beyond that.
    ``states``: the rule of a model with recurrent layers; ``events``: ``hash_block`` and ``hash_block_size``,
    for KV cache events."""
    setup = SimpleNamespace(
        states=states,
        rank_fingerprints=RANKS,
        store_lookup=lambda: None,
        block_sizes=(32,),
        event_groups=(Group(0, 32, "full_attention"),),
        config=SimpleNamespace(stored=True, settings=SimpleNamespace(namespace=None)),
        events=bool(events),
    )
    scheduler = SchedulerSide(setup, **events)
    held = [key for rank in RANKS for key in chunk_keys(PROMPT[: 3 * CHUNK_TOKENS], root_key(rank))]
    scheduler.worker_output(WorkerReport(changes=[(key, None) for key in held]))
    return scheduler


def _request(req_id: str = "r", cache_salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=PROMPT, all_token_ids=PROMPT, cache_salt=cache_salt)


def test_kv_cache_events_place_the_chains_of_a_cache_salt_once_a_request_has_used_it():
    scheduler = _scheduler(hash_block=lambda parent, tokens, salt: (parent, tuple(tokens), salt), hash_block_size=32)
    first = [
        Residency(key, HOST, True, tuple(PROMPT[:CHUNK_TOKENS]))
        for key in (chunk_keys(PROMPT[:CHUNK_TOKENS], root_key(rank, "s"))[0] for rank in RANKS)
    ]
    scheduler.worker_output(WorkerReport(residency=first))
    assert scheduler.take_events() == [Cleared()]  # no request has used the salt: its chains are not placed
    assert scheduler.matched_tokens(_request(cache_salt="s"), 0) == 0  # none of it indexed, but the salt is noted
    scheduler.worker_output(WorkerReport(residency=first))  # told again: a load put it in the pool
    (stored,) = scheduler.take_events()
    assert stored.medium == "CPU" and [b.salt for b in stored.blocks] == ["s", "s"]
    assert stored.blocks[0].hash == (None, tuple(PROMPT[:32]), "s")  # the salt in the first block's hash alone


def test_a_prefix_is_offered_once_every_rank_holds_it_as_far_as_the_shortest_holds():
    scheduler, request = _scheduler(), _request()
    assert scheduler.matched_tokens(request, 0) is None  # found: the workers are asked to hold it first
    step = scheduler.build(NO_BATCH)
    assert [(ask.req_id, len(ask.tokens)) for ask in step.pins] == [("r", 3 * CHUNK_TOKENS)] and not step.loads
    scheduler.worker_output(WorkerReport(pinned=[Pinned("r", 0, 3, None)]))
    assert scheduler.matched_tokens(request, 0) is None  # rank 1 has not answered
    scheduler.worker_output(WorkerReport(pinned=[Pinned("r", 1, 2, MissReason.EVICTED)]))  # its third chunk went since
    assert scheduler.matched_tokens(request, CHUNK_TOKENS) == CHUNK_TOKENS  # two held, one of them vLLM's own hit
    scheduler.after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7],)), CHUNK_TOKENS)
    step = scheduler.build(NO_BATCH)
    (job,) = step.loads
    assert (job.start, job.end, job.block_ids) == (CHUNK_TOKENS, 2 * CHUNK_TOKENS, [[4, 5, 6, 7]])
    assert not step.pins and not step.unpins
    computed = SimpleNamespace(req_id="r", block_ids=([4, 5, 6, 7],), num_computed_tokens=2 * CHUNK_TOKENS)  # loaded
    batch = SimpleNamespace(
        num_scheduled_tokens={"r": CHUNK_TOKENS + 1},
        scheduled_new_reqs=[computed],
        scheduled_cached_reqs=NOTHING_CACHED,
    )
    (first,) = scheduler.build(batch).requests
    assert first.misses == {"evicted": CHUNK_TOKENS}  # the third chunk, for the request's record
    assert scheduler.matched_tokens(request, 0) is None  # asked again after its load (preempted): a new lifecycle


def test_a_held_prefix_is_let_go_where_no_load_follows():
    scheduler = _scheduler()
    ended, declined, covered = _request("ended"), _request("declined"), _request("covered")
    for request in (ended, declined, covered):
        assert scheduler.matched_tokens(request, 0) is None
    scheduler.build(NO_BATCH)
    answers = [Pinned(r.request_id, rank, 3, None) for r in (ended, declined, covered) for rank in (0, 1)]
    scheduler.worker_output(WorkerReport(pinned=answers))
    scheduler.finished(ended)  # aborted while it waited
    assert scheduler.matched_tokens(declined, 0) == 3 * CHUNK_TOKENS
    scheduler.after_alloc(declined, SimpleNamespace(get_block_ids=lambda: ([],)), 0)  # vLLM took none of it
    assert scheduler.matched_tokens(covered, 3 * CHUNK_TOKENS) == 0  # vLLM's own hit covers what is held
    step = scheduler.build(NO_BATCH)
    assert sorted(step.unpins) == ["covered", "declined", "ended"] and not step.loads


def test_nothing_past_vllms_own_hit_asks_nothing_of_the_workers():
    scheduler = _scheduler()
    assert scheduler.matched_tokens(_request(), 3 * CHUNK_TOKENS) == 0
    step = scheduler.build(NO_BATCH)
    assert not step.pins and not step.unpins


def test_a_hybrids_prefix_is_held_and_offered_to_its_last_state_checkpoint_alone():
    """A model whose layer 0 is recurrent, a state checkpoint every second chunk: of three chunks stored, two
    are held and offered, the third named ``no_state``."""
    spec = SimpleNamespace(num_layers=2, is_recurrent=lambda layer: layer == 0)
    scheduler, request = _scheduler(StateRule(spec, every=2, at_step_end=True)), _request()
    assert scheduler.matched_tokens(request, 0) is None
    (ask,) = scheduler.build(NO_BATCH).pins
    assert len(ask.tokens) == 2 * CHUNK_TOKENS
    scheduler.worker_output(WorkerReport(pinned=[Pinned("r", rank, 2, None) for rank in range(2)]))
    assert scheduler.matched_tokens(request, 0) == 2 * CHUNK_TOKENS
    scheduler.after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7],)), 2 * CHUNK_TOKENS)
    (job,) = scheduler.build(NO_BATCH).loads
    computed = SimpleNamespace(req_id="r", block_ids=([4, 5, 6, 7],), num_computed_tokens=job.end)
    batch = SimpleNamespace(
        num_scheduled_tokens={"r": CHUNK_TOKENS + 1},
        scheduled_new_reqs=[computed],
        scheduled_cached_reqs=NOTHING_CACHED,
    )
    (first,) = scheduler.build(batch).requests
    assert first.misses == {"no_state": CHUNK_TOKENS}
