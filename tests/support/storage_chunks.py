"""Deterministic test chunks: chunk ``i`` always has the same key, tokens and tensors, so a test can check
any chunk a store serves against what was written."""

import mmap

import torch

from hcache.bench.storage import publish as bench_publish
from hcache.storage.chunk import Chunk, decode, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, next_key, root_key

FINGERPRINT = "test-model"
ROOT = root_key(FINGERPRINT)


def chunk(i: int, width: int = 64, layers: int = 2) -> Chunk:
    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(0, 1000, (CHUNK_TOKENS,), generator=g).tolist()
    tensors = {(layer, "H"): torch.randn(CHUNK_TOKENS, width, generator=g) for layer in range(layers)}
    return Chunk(next_key(ROOT, tokens + [i]), tokens, FINGERPRINT, tensors)


def chained(n: int, seed: int = 0) -> list[Chunk]:
    """``n`` chunks of one sequence, each naming the one before it as its parent."""
    g = torch.Generator().manual_seed(seed)
    keys = KeyChain(ROOT)
    done = keys.extend(torch.randint(0, 1000, (n * CHUNK_TOKENS,), generator=g).tolist())
    return [
        Chunk(key, tokens, FINGERPRINT, {(0, "H"): torch.randn(CHUNK_TOKENS, 32, generator=g)}, keys.parent(i))
        for i, (key, tokens) in enumerate(done)
    ]


def chunk_bytes(i: int, **kw) -> tuple[str, bytes]:
    c = chunk(i, **kw)
    return c.key, encode(c)


def read_back(store, key: str) -> bytes | None:
    """A chunk's file image as a disk store serves it (one read into a page-aligned buffer), or None."""
    bufs = []

    def take(size: int) -> memoryview:
        bufs.append(mmap.mmap(-1, max(size + 4095, 4096) // 4096 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        return memoryview(bufs[-1])

    size = store.read_into(key, take)
    return None if size is None else bytes(bufs[-1][:size])


def check_served(store, key: str, expected: Chunk) -> None:
    """The store serves ``key`` whole: header, tokens and every tensor checksum verify and match."""
    check_bytes(read_back(store, key), key, expected)


def check_bytes(data: bytes, key: str, expected: Chunk) -> None:
    got = decode(data, key)
    assert got.tokens == expected.tokens and got.fingerprint == FINGERPRINT
    assert got.tensors.keys() == expected.tensors.keys()
    for name, t in expected.tensors.items():
        assert torch.equal(got.tensors[name], t)


def publish(tier, c: Chunk) -> None:
    """Save ``c`` as the saver does: lay it out in a pool slot, fill its rows, publish it."""
    assert bench_publish(tier, c), "the pool has no room"


def check_image(image, expected: Chunk) -> None:
    assert image.key == expected.key and image.tokens == expected.tokens
    for name, t in expected.tensors.items():
        assert torch.equal(image.tensor(*name), t)
