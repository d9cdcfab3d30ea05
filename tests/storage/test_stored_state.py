"""Stored state's setting (:mod:`hcache.storage.stored_state`): the values ``stored_dtype`` takes, and the
ones refused."""

import pytest
import torch

from hcache.config import HCacheConfig
from hcache.errors import InvalidRequestError
from hcache.storage.stored_state import stored_encodings

INT8, FP8 = torch.int8, torch.float8_e4m3fn


def test_stored_dtype_values():
    assert stored_encodings("auto") == {}
    assert stored_encodings("int8") == {"H": INT8, "KV": INT8}
    assert stored_encodings("8bit") == {"H": FP8, "KV": INT8}
    assert stored_encodings(" H=fp8 , kv=auto ") == {"H": FP8}
    for bad in ("int4", "H=fp8,H=int8", "Q=int8"):
        with pytest.raises(InvalidRequestError, match="stored_dtype"):
            HCacheConfig.of(stored_dtype=bad)
