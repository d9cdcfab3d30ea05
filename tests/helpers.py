import torch

from hcache.model_loader import LoadedModel, load_model

_cache: dict[str, LoadedModel] = {}


def loaded(name: str) -> LoadedModel:
    """Load each model once per test session."""
    if name not in _cache:
        _cache[name] = load_model(name)
    return _cache[name]


def random_prompt(n: int, vocab: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=rng).tolist()
