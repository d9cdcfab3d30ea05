"""Exceptions users of hcache can catch. All derive from :class:`HCacheError`."""


class HCacheError(Exception):
    """Base class for every error hcache raises on purpose."""


class UnsupportedModelError(HCacheError):
    """The model's architecture is not one hcache can restore."""


class ModelNotFoundError(HCacheError):
    """A model path or name that does not resolve to a loadable model."""


class InvalidRequestError(HCacheError, ValueError):
    """A request that cannot be served as given (empty, too long, bad token ids, bad plan)."""


class StorageError(HCacheError):
    """The chunk store cannot be used (unwritable directory, bad layout version)."""


class CacheFullError(HCacheError):
    """The device KV cache has no free block for the request."""


class ServerStartError(HCacheError):
    """A server process of a deployment exited while it started; the message carries its reason."""
