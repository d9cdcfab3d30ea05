import torch

from hcache.model_loader import LoadedModel, load_model
from hcache.storage.chunk import ChunkReader

_cache: dict[str, LoadedModel] = {}


def loaded(name: str) -> LoadedModel:
    """Load each model once per test session."""
    if name not in _cache:
        _cache[name] = load_model(name)
    return _cache[name]


def random_prompt(n: int, vocab: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=rng).tolist()


def corrupt_tensor(store, key: str, layer: int, fmt: str, tokens: list[int], fingerprint: str) -> None:
    """Flip one byte inside a stored tensor, leaving the header intact."""
    with store.open(key) as f:
        reader = ChunkReader.open(f, key, tokens, fingerprint)
        offset = reader.data_start + reader.entries[(layer, fmt)]["data_offsets"][0]
    path = store.path(key)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
