"""hcache: restore LLM state from saved hidden states (HCache, EuroSys '25).

The names below are imported on first use (PEP 562): ``import hcache``, and with it the command line's
``--help``, does not import torch.
"""

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


def _exports() -> dict:
    from .config import HCacheConfig
    from .errors import HCacheError, InvalidRequestError, ModelNotFoundError, StorageError, UnsupportedModelError
    from .model.loader import load_model
    from .model.spec import ModelSpec
    from .planning.plan import Method, RestorePlan
    from .serving.runtime import HCacheRuntime, RequestResult

    return locals()


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(_exports())
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
