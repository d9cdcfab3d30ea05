"""hcache's tiers told as vLLM's KV cache events: each KV cache group's blocks, named by vLLM's hashes at its
hash block size, chained as vLLM chains them, announced on a medium once every chunk a load of them reads
holds the group's layers there on every rank, removed when one no longer does, and never for a chunk whose
chain cannot be placed. A router taking a hit as vLLM takes its own finds what hcache's own rules load: a
recurrent group's blocks only where a checkpoint's state is held, a sliding group's only while the window a
load reads is."""

import hashlib

import pytest
import torch
from support.vllm_hits import vllm_hit
from transformers import AutoConfig

from hcache.model.spec import ModelSpec
from hcache.planning.window import WindowRule
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from hcache.storage.chunk_store import Loss
from hcache.storage.residency import HOST, Kept, Residency
from hcache.vllm.events import CPU, STORAGE, BlockEvents, Cleared, Group, Removed, Roots, Stored

FPS = ("rank-0", "rank-1")
TOKENS = list(range(1000, 1000 + 4 * CHUNK_TOKENS))


def _hash(parent, tokens, salt) -> bytes:
    return hashlib.sha256(repr((parent, tuple(tokens), salt)).encode()).digest()


def _vllm_hashes(tokens, size, salt=None) -> list[bytes]:
    """vLLM's chain over ``tokens``, block by block, as the engine hashes a request's blocks."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - size + 1, size):
        parent = _hash(parent, tokens[start : start + size], salt if parent is None else None)
        hashes.append(parent)
    return hashes


def _chunks(fp: str, salt: str | None = None, tokens=TOKENS) -> list[tuple[str, list[int], str]]:
    """Each chunk's key, tokens and parent key, as rank ``fp`` keys them."""
    chain = KeyChain(root_key(fp, salt))
    return [(key, toks, chain.parent(i)) for i, (key, toks) in enumerate(chain.extend(tokens))]


def _events(block_size: int, ranks: int = 1, salts=(None,), groups=None) -> BlockEvents:
    """Events in ``groups`` (one of full attention in blocks of ``block_size`` if none are given)."""
    roots = {root_key(fp, salt): salt for fp in FPS for salt in salts}

    def first(key, tokens):
        found = [s for r, s in roots.items() if KeyChain(r).extend(tokens)[0][0] == key]
        return (True, found[0]) if found else (False, None)

    events = BlockEvents(_hash, block_size, ranks, first, groups or (Group(0, block_size, "full_attention"),))
    assert events.take() == [Cleared()]  # once, at start: what this node held before is gone
    return events


def _held(chunk, tier=HOST, layers=None) -> Residency:
    key, tokens, parent = chunk
    return Residency(key, tier, True, tuple(tokens), parent, layers=layers)


def _left(chunk, tier=HOST) -> Residency:
    return Residency(chunk[0], tier, False, why=Loss.EVICTED)


def test_blocks_smaller_than_a_chunk_are_announced_with_it_in_vllms_chain():
    events, chunks = _events(16), _chunks(FPS[0])
    events.apply([_held(chunks[0]), _held(chunks[1])])
    first, second = events.take()
    want = _vllm_hashes(TOKENS[:128], 16)
    assert isinstance(first, Stored) and first.medium == CPU
    assert [b.hash for b in first.blocks] == want[:4] and [b.hash for b in second.blocks] == want[4:]
    assert first.blocks[0].parent is None and second.blocks[0].parent == want[3]
    assert [t for b in first.blocks + second.blocks for t in b.tokens] == TOKENS[:128]


def test_a_block_spanning_two_chunks_waits_for_both_and_leaves_with_either():
    events, chunks = _events(128), _chunks(FPS[0])
    events.apply([_held(chunks[0])])
    assert events.take() == []  # half a block
    events.apply([_held(chunks[1])])
    (stored,) = events.take()
    assert [b.hash for b in stored.blocks] == _vllm_hashes(TOKENS[:128], 128)
    events.apply([_held(chunks[0], "disk"), _held(chunks[1], "redis")])
    assert events.take() == [Stored(stored.blocks, STORAGE, stored.group)]  # any store below the pool
    events.apply([_left(chunks[0])])
    assert events.take() == [Removed((stored.blocks[0].hash,), CPU, stored.group)]
    events.apply([_left(chunks[1], "redis")])
    assert events.take() == [Removed((stored.blocks[0].hash,), STORAGE, stored.group)]
    events.apply([_held(chunks[0]), _held(chunks[1], "disk")])  # both in the pool again; both in a store again
    assert events.take() == [stored, Stored(stored.blocks, STORAGE, stored.group)]


def test_with_tensor_parallelism_a_block_is_announced_once_every_rank_holds_it():
    events = _events(64, ranks=2)
    rank0, rank1 = _chunks(FPS[0]), _chunks(FPS[1])
    events.apply([_held(rank0[0])])
    assert events.take() == []
    events.apply([_held(rank1[0])])
    (stored,) = events.take()
    assert [b.hash for b in stored.blocks] == _vllm_hashes(TOKENS[:64], 64)
    events.apply([_left(rank1[0])])
    assert events.take() == [Removed((stored.blocks[0].hash,), CPU, stored.group)]


def test_a_chunk_whose_chain_cannot_be_placed_is_not_announced():
    events, chunks = _events(16), _chunks(FPS[0])
    events.apply([_held(chunks[1])])  # its parent never seen
    events.apply([_held(_chunks(FPS[0], salt="unknown")[0])])  # rooted under a salt no request used here
    assert events.take() == [] and events.unplaced == 2


def test_a_cache_salt_is_hashed_into_the_first_block_as_vllm_does():
    events, chunks = _events(64, salts=(None, "tenant")), _chunks(FPS[0], salt="tenant")
    events.apply([_held(chunks[0]), _held(chunks[1])])
    first, second = events.take()
    assert [first.blocks[0].hash, second.blocks[0].hash] == _vllm_hashes(TOKENS[:128], 64, salt="tenant")
    assert first.blocks[0].salt == "tenant"
    assert first.blocks[0].hash != _vllm_hashes(TOKENS[:64], 64)[0]


def test_a_chunk_held_nowhere_is_forgotten_and_announced_again_when_it_returns():
    events, chunks = _events(64), _chunks(FPS[0])
    events.apply([_held(chunks[0]), _left(chunks[0]), _held(chunks[0])])
    stored, removed, again = events.take()
    assert again == stored and removed == Removed((stored.blocks[0].hash,), CPU, stored.group)


def test_roots_place_the_deployments_chains_unsalted_and_those_of_the_latest_cache_salts_under_theirs():
    """One rule for vLLM's connector and ``hcache serve``: every rank's root under the deployment's namespace,
    and under each of the latest cache_salts requests used (``kept`` roots); none other."""
    roots = Roots(FPS, "team-a", kept=4)  # two salts of two ranks

    def first(fp, salt):
        key, tokens, _ = _chunks(fp, salt)[0]
        return roots(key, tokens)

    assert first(FPS[0], "team-a") == first(FPS[1], "team-a") == (True, None)
    assert first(FPS[0], None) == first(FPS[0], "s1") == (False, None)
    for salt in ("s1", "s2", "s1", "s3"):  # s1 used again: s2 is the oldest when s3 comes
        roots.salted(salt)
    assert [first(FPS[1], salt) for salt in ("s1", "s2", "s3")] == [(True, "s1"), (False, None), (True, "s3")]
    key, tokens, _ = _chunks(FPS[0], "s1")[1]
    assert roots(key, tokens) == (False, None)  # a chunk after the first is its parent's to place


def test_a_groups_blocks_are_named_by_the_hash_block_each_ends_with_as_vllm_names_them():
    """vLLM's ``BlockHashListWithBlockSize``: a group of 128-token blocks over 64-token hash blocks names a
    block by the hash of the hash block it ends with, and its parent by the one ending the block before."""
    full = Group(0, 128, "full_attention")
    events, chunks = _events(64, groups=(full,)), _chunks(FPS[0])
    events.apply([_held(chunk) for chunk in chunks])
    first, second = events.take()
    want = _vllm_hashes(TOKENS, 64)
    assert [b.hash for b in first.blocks + second.blocks] == want[1::2] and first.group == second.group == full
    assert (first.blocks[0].parent, second.blocks[0].parent) == (None, want[1])
    assert first.blocks[0].tokens == tuple(TOKENS[:128]) and second.blocks[0].tokens == tuple(TOKENS[128:])


# A hybrid's two groups, vLLM's shape scaled down: attention (layer 1) and a recurrent state (layer 0), both in
# blocks of two chunks, the hash block too; vLLM checkpoints the state at each block's end.
ATTENTION = Group(0, 128, "full_attention")
STATE = Group(1, 128, "mamba", kept=Kept.CHECKPOINTS, layers=frozenset({0}))
WITH_STATE, WITHOUT = frozenset({0, 1}), frozenset({1})


def _cached(events: list, on: str) -> set:
    """(group, hash) of each block the events leave announced on ``on``."""
    held = set()
    for event in events:
        if isinstance(event, (Stored, Removed)) and event.medium == on:
            if isinstance(event, Stored):
                held |= {(event.group.index, b.hash) for b in event.blocks}
            else:
                held -= {(event.group.index, h) for h in event.hashes}
    return held


def _hit(cached: set, groups, tokens: list[int], hash_block: int) -> int:
    """What a router finds of ``tokens`` (one more than the chunks: vLLM leaves the last out) in ``cached``."""
    kinds = [(g.index, g.kind, g.window, g.block_size) for g in groups]
    hashes = _vllm_hashes(tokens, hash_block)
    return vllm_hit(lambda g, h: (g, h) in cached, kinds, hashes, hash_block, len(tokens) - 1)


def test_a_recurrent_groups_block_is_announced_only_where_its_checkpoints_state_is_held():
    """Chunk 1 holds the state at 128, chunk 3 none at 256 (a longer step passed it): the state group's block
    at 128 alone is announced, and a router finds 128 tokens, as a load restores only to a stored state. The
    chunk saved again with its state announces the block at 256; the checkpoint chunk leaving the pool removes
    both groups' blocks there; a store that does not say what a chunk holds announces no state."""
    groups = (ATTENTION, STATE)
    events, chunks = _events(128, groups=groups), _chunks(FPS[0])
    states = [WITHOUT, WITH_STATE, WITHOUT, WITHOUT]
    events.apply([_held(chunk, layers=layers) for chunk, layers in zip(chunks, states)])
    told = events.take()
    attention, state, later = told
    want = _vllm_hashes(TOKENS, 128)
    assert attention.group == ATTENTION and state.group == STATE and later.group == ATTENTION
    assert [b.hash for b in state.blocks] == want[:1] and state.blocks[0].tokens == tuple(TOKENS[:128])
    prompt = TOKENS + [7]  # a returning prompt: every stored chunk, and one token more
    assert _hit(_cached(told, CPU), groups, prompt, 128) == 128

    events.apply([_held(chunks[3], layers=WITH_STATE)])  # saved again, by a step that ended on it
    (state_256,) = events.take()
    assert state_256.group == STATE and [b.hash for b in state_256.blocks] == want[1:2]
    assert state_256.blocks[0].parent == want[0]
    told += [state_256]
    assert _hit(_cached(told, CPU), groups, prompt, 128) == 256

    events.apply([_left(chunks[1])])
    removed = events.take()
    assert removed == [Removed((want[0],), CPU, ATTENTION), Removed((want[0],), CPU, STATE)]
    assert _hit(_cached(told + removed, CPU), groups, prompt, 128) == 0

    events.apply([_held(chunk, "disk") for chunk in chunks])  # no layers said: the attention's blocks alone
    assert {e.group for e in events.take()} == {ATTENTION}


def _windowed(window: int) -> ModelSpec:
    """A sliding layer (0) and a full-attention one (1), as Gemma's."""
    config = AutoConfig.for_model(
        "qwen2",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
    )
    return ModelSpec.from_config(config, torch.float32)


@pytest.mark.parametrize("window", [96, 80, 97, 65])
def test_a_sliding_groups_blocks_are_announced_only_while_the_window_a_load_reads_is_held(window):
    """A conversation saved in two turns, of 256 and 512 tokens, each save keeping the sliding layer's rows of
    its last window only (:class:`WindowRule`). A router takes a hit over the announced blocks as vLLM takes
    its own: for a prompt of whole chunks it finds what the window rule restores, where hcache's window starts
    a block before vLLM's too (65 and 97 tokens in blocks of 32); for one ending inside a chunk, never more
    whole chunks (a load restores whole chunks, so the block in the last one is the router's alone). Blocks
    announced by the chunks they overlap alone failed both. A chunk of the window leaving the pool takes its
    sliding blocks with it."""
    block, spec = 32, _windowed(window)
    rule = WindowRule(spec, block)
    full = Group(0, block, "full_attention")
    sliding = Group(1, block, "sliding_window", window, Kept.WINDOW, frozenset({0}), block)
    tokens = list(range(2000, 2000 + 8 * CHUNK_TOKENS))
    chunks = _chunks(FPS[0], tokens=tokens)
    layers = [frozenset({1} | ({0} if rule.saves(0, c, 256 if c < 4 else 512) else set())) for c in range(8)]
    assert layers[0] == {1} and layers[7] == {0, 1}  # a save keeps its last window only
    events = _events(block, groups=(full, sliding))
    events.apply([_held(chunk, layers=held) for chunk, held in zip(chunks, layers)])
    told = events.take()
    announced = {(e.blocks[0].tokens[0] - tokens[0]) // CHUNK_TOKENS for e in told if e.group == sliding}
    assert announced and announced <= {c for c in range(8) if 0 in layers[c]}
    for length in range(CHUNK_TOKENS, 8 * CHUNK_TOKENS + 1, block):  # a prompt continuing so many tokens
        found = _hit(_cached(told, CPU), (full, sliding), tokens[:length] + [7], block) // CHUNK_TOKENS
        n = length // CHUNK_TOKENS
        loads = rule.usable([0, 1], 0, n, lambda m: m * CHUNK_TOKENS, lambda j, layer: layer in layers[j])
        assert found == loads if length % CHUNK_TOKENS == 0 else found <= loads

    events.apply([_left(chunks[7])])
    gone = events.take()
    assert {e.group for e in gone} == {full, sliding}
    assert _hit(_cached(told + gone, CPU), (full, sliding), tokens + [7], block) < 8 * CHUNK_TOKENS
