"""hcache: restore LLM state from saved hidden states (HCache, EuroSys '25)."""
from .errors import HCacheError, InvalidRequestError, ModelNotFoundError, StorageError, UnsupportedModelError
from .model_loader import load_model
from .model_spec import ModelSpec
from .plan import Method, RestorePlan
from .runtime import HCacheRuntime, RequestResult

__version__ = "0.1.0"
__all__ = [
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
    "load_model",
]
