"""hcache: restore LLM state from saved hidden states (HCache, EuroSys '25)."""
from .config import HCacheConfig
from .errors import HCacheError, InvalidRequestError, ModelNotFoundError, StorageError, UnsupportedModelError
from .model_loader import load_model
from .model_spec import ModelSpec
from .plan import Method, RestorePlan
from .runtime import HCacheRuntime, RequestResult
from .version import __version__

__all__ = [
    "HCacheConfig",
    "HCacheError",
    "HCacheRuntime",
    "InvalidRequestError",
    "Method",
    "ModelNotFoundError",
    "ModelSpec",
    "RequestResult",
    "RestorePlan",
    "StorageError",
    "UnsupportedModelError",
    "__version__",
    "load_model",
]
