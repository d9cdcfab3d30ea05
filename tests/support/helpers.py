import pytest
import torch

from hcache.model.loader import LoadedModel, load_model
from hcache.storage.chunk import ChunkImage

_cache: dict[str, LoadedModel] = {}


# The quick check's families, one of each kind: RoPE with GQA (llama), learned positions (opt), Q/K normed
# before RoPE (qwen3), sliding and full layers with two RoPE bases (gemma3_text), Mamba layers beside
# attention (granitemoehybrid). The others are variations of these and run in the whole suite (`slow`).
QUICK_FAMILIES = frozenset({"llama", "opt", "qwen3", "gemma3_text", "granitemoehybrid"})


def family_params(model_types) -> list:
    """``model_types`` as fixture params, those outside :data:`QUICK_FAMILIES` marked ``slow``."""
    return [t if t in QUICK_FAMILIES else pytest.param(t, marks=pytest.mark.slow) for t in model_types]


def loaded(name: str) -> LoadedModel:
    """Load each model once per test session."""
    if name not in _cache:
        _cache[name] = load_model(name)
    return _cache[name]


def random_prompt(n: int, vocab: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=rng).tolist()


def corrupt_tensor(store, key: str, layer: int, fmt: str) -> None:
    """Flip one byte inside a stored tensor on disk, leaving the header intact, and evict the chunk from
    host memory, so that the next restore reads the damaged file."""
    store.flush()
    store.drop_resident()
    path = store.stores[0].path(key)
    data = bytearray(path.read_bytes())
    image = ChunkImage.parse(torch.frombuffer(data, dtype=torch.uint8), key, len(data), verify=False)
    data[image.layout.entries[(layer, fmt)].offset] ^= 0xFF
    path.write_bytes(bytes(data))


def serving_engine(
    engine, fingerprint: str, store_dir, model_name: str = "test", shareable_pool: bool = False, **settings
):
    """A serving engine over ``engine``, by ``settings`` (:class:`~hcache.config.HCacheConfig`) resolved for
    its model, as the runtime builds one (``shareable_pool``: as vLLM's CPU worker builds its stack)."""
    from hcache.resolve import resolve
    from hcache.serving.engine import ServingEngine
    from hcache.serving.store_stack import StoreStack

    config = resolve({"store_dirs": store_dir, **settings}, engine.spec, model_name)
    return ServingEngine(engine, StoreStack(config, engine, fingerprint, shareable_pool=shareable_pool))
