"""hcache as a DeepSpeed-MII backend: ``mii.pipeline`` and ``mii.serve`` with hcache's restore and save.

    import hcache.mii
    pipe = hcache.mii.pipeline("path/to/model", hcache={"store_dirs": ["/nvme0/hc", "/nvme1/hc"]})
    client = hcache.mii.serve("path/to/model", hcache={"plan": "auto", "profile": "profiles/x.json"},
                              enable_restful_api=True)

Both take MII's own arguments too, and return MII's own pipeline and client.
"""

from __future__ import annotations

import importlib

# Handed on when first asked for: they import torch, and `hcache serve --help` imports this package.
_HANDED_ON = {
    "pipeline": ".deployment",
    "serve": ".deployment",
    "HCacheConfig": "..config",
    "build_engine": ".engine_factory",
}
__all__ = list(_HANDED_ON)


def __getattr__(name: str):
    if name not in _HANDED_ON:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HANDED_ON[name], __name__), name)
