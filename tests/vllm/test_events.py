"""hcache's tiers told as vLLM's KV cache events: blocks at vLLM's hash block size, chained as vLLM chains
them, announced on a medium once every chunk they overlap is held there by every rank, removed when one
leaves, and never for a chunk whose chain cannot be placed."""

import hashlib

from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from hcache.storage.chunk_store import Loss
from hcache.storage.residency import HOST, Residency
from hcache.vllm.events import CPU, STORAGE, BlockEvents, Cleared, Removed, Roots, Stored

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


def _events(block_size: int, ranks: int = 1, salts=(None,)) -> BlockEvents:
    roots = {root_key(fp, salt): salt for fp in FPS for salt in salts}

    def first(key, tokens):
        found = [s for r, s in roots.items() if KeyChain(r).extend(tokens)[0][0] == key]
        return (True, found[0]) if found else (False, None)

    events = BlockEvents(_hash, block_size, ranks, first)
    assert events.take() == [Cleared()]  # once, at start: what this node held before is gone
    return events


def _held(chunk, tier=HOST) -> Residency:
    key, tokens, parent = chunk
    return Residency(key, tier, True, tuple(tokens), parent)


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
    assert events.take() == [Stored(stored.blocks, STORAGE)]  # any store below the pool
    events.apply([_left(chunks[0])])
    assert events.take() == [Removed((stored.blocks[0].hash,), CPU)]
    events.apply([_left(chunks[1], "redis")])
    assert events.take() == [Removed((stored.blocks[0].hash,), STORAGE)]
    events.apply([_held(chunks[0]), _held(chunks[1], "disk")])  # both in the pool again; both in a store again
    assert events.take() == [stored, Stored(stored.blocks, STORAGE)]


def test_with_tensor_parallelism_a_block_is_announced_once_every_rank_holds_it():
    events = _events(64, ranks=2)
    rank0, rank1 = _chunks(FPS[0]), _chunks(FPS[1])
    events.apply([_held(rank0[0])])
    assert events.take() == []
    events.apply([_held(rank1[0])])
    (stored,) = events.take()
    assert [b.hash for b in stored.blocks] == _vllm_hashes(TOKENS[:64], 64)
    events.apply([_left(rank1[0])])
    assert events.take() == [Removed((stored.blocks[0].hash,), CPU)]


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
    assert again == stored and removed == Removed((stored.blocks[0].hash,), CPU)


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
