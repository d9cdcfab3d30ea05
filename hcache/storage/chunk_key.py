"""Content addresses of 64-token chunks.

A chunk's key chains over every token before it: ``key_i = H(key_{i-1} || tokens_i)``, rooted in the model
fingerprint, the layout version and an optional namespace. So any client that resends a history finds the
longest stored prefix without a session id, and two tenants with different namespaces never share a chunk.
BLAKE2b (not a fast non-cryptographic hash) because a key collision would serve one user another's state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidRequestError

CHUNK_TOKENS = 64
LAYOUT_VERSION = 1
_DIGEST = 16
MAX_NAMESPACE_CHARS = 256


def check_namespace(namespace: object, name: str = "namespace") -> str | None:
    """A namespace (a deployment's, or a request's ``name``) is ``None`` or a non-empty string of printable
    characters."""
    if namespace is None:
        return None
    if (
        not isinstance(namespace, str)
        or not namespace
        or len(namespace) > MAX_NAMESPACE_CHARS
        or not namespace.isprintable()
    ):
        raise InvalidRequestError(
            f"{name} must be a non-empty string of at most {MAX_NAMESPACE_CHARS} printable characters, not {namespace!r:.80}"
        )
    return namespace


def root_key(fingerprint: str, namespace: str | None = None) -> str:
    """The chain's anchor: state is only shared under the same model, dtype, layout and namespace."""
    seed = f"hcache/v{LAYOUT_VERSION}|{fingerprint}|{namespace or ''}".encode()
    return hashlib.blake2b(seed, digest_size=_DIGEST).hexdigest()


def next_key(parent: str, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=_DIGEST)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.hexdigest()


_CONTENT_ROOT = hashlib.blake2b(b"hcache/content", digest_size=_DIGEST).hexdigest()


def content_key(tokens: Sequence[int]) -> str:
    """A first chunk's tokens, under no model or namespace: what :mod:`.anchor_log` files a prefix by."""
    return next_key(_CONTENT_ROOT, tokens[:CHUNK_TOKENS])


def chunk_keys(tokens: Sequence[int], root: str) -> list[str]:
    """Keys of every full chunk of ``tokens``; a trailing partial chunk has none."""
    return [key for key, _ in KeyChain(root).extend(tokens)]


class KeyChain:
    """The chain over a growing token sequence, from its root: ``chunks`` holds the key and tokens of every
    full chunk so far, ``key`` the last key (the root before the first), ``tail`` the tokens after them.
    A sequence's chain has one owner, the serving engine; the saver reads chunk keys from it."""

    def __init__(self, key: str):
        self.key = key
        self.tail: list[int] = []
        self.chunks: list[tuple[str, list[int]]] = []

    def extend(self, tokens: Sequence[int]) -> list[tuple[str, list[int]]]:
        """Append ``tokens``; the key and tokens of each chunk they complete."""
        self.tail.extend(tokens)
        done = []
        while len(self.tail) >= CHUNK_TOKENS:
            chunk, self.tail = self.tail[:CHUNK_TOKENS], self.tail[CHUNK_TOKENS:]
            self.key = next_key(self.key, chunk)
            done.append((self.key, chunk))
        self.chunks += done
        return done

    def chunk(self, index: int) -> tuple[str, list[int]] | None:
        """Key and tokens of the sequence's chunk ``index``, once all its tokens are known."""
        return self.chunks[index] if index < len(self.chunks) else None

    def parent(self, index: int) -> str:
        """The key of the chunk before chunk ``index`` ("" for the first: its root is no chunk)."""
        return self.chunks[index - 1][0] if index > 0 else ""
