"""Deterministic test chunks: chunk ``i`` always has the same key, tokens and tensors, so a test can check
any chunk a store serves against what was written."""
import torch

from hcache.storage.chunk import Chunk, ChunkReader, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, next_key, root_key

FINGERPRINT = "test-model"
ROOT = root_key(FINGERPRINT)


def chunk(i: int, width: int = 64, layers: int = 2) -> Chunk:
    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(0, 1000, (CHUNK_TOKENS,), generator=g).tolist()
    tensors = {(layer, "H"): torch.randn(CHUNK_TOKENS, width, generator=g) for layer in range(layers)}
    return Chunk(next_key(ROOT, tokens + [i]), tokens, FINGERPRINT, tensors)


def chunk_bytes(i: int, **kw) -> tuple[str, bytes]:
    c = chunk(i, **kw)
    return c.key, encode(c)


def check_served(store, key: str, expected: Chunk) -> None:
    """The store serves ``key`` whole: header, tokens and every tensor checksum verify and match."""
    with store.open(key) as f:
        check_file(f, key, expected)


def check_file(f, key: str, expected: Chunk) -> None:
    reader = ChunkReader.open(f, key, expected.tokens, FINGERPRINT)
    for name, t in expected.tensors.items():
        assert torch.equal(reader.read(*name), t)
