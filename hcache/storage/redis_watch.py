"""A Redis server's keyspace notifications for one key prefix: what every node writes and deletes there, and
what the server itself expires or evicts, as it happens, in the server's own order.

Notifications are off on a new server, and a server forgets them when it restarts: the watch turns on what
it needs (``CONFIG SET notify-keyspace-events``) each time it subscribes. A managed server that refuses
``CONFIG`` must have them on already (:data:`FLAGS`), or the watch does not start. Pub/sub delivers at most
once: while the connection is down, changes go unseen, so a lost connection is told (``blind``) before the
watch subscribes again. Nothing is notified of a ``FLUSHDB``. A cluster's notifications are each node's own,
and are not followed here.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

import redis

from ..errors import StorageError

log = logging.getLogger(__name__)

SETTING = "notify-keyspace-events"
FLAGS = "K$gxe"  # keyspace channels; string commands (SET); generic ones (DEL); expiries; evictions
EVENTS = ("set", "del", "expired", "evicted")
_ALL = "g$lshzxetd"  # what the flag ``A`` stands for
_WAIT_S = 0.2  # how long one read waits for a message: how soon close() is seen


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class KeyspaceWatch:
    """``event(key, what)`` for each of :data:`EVENTS` on a key under ``prefix`` (the key without it), and
    ``blind()`` when the connection was lost, from a thread of its own. ``connect`` makes a client that
    does not retry: a reconnection must not pass unseen."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        prefix: str,
        *,
        name: str,
        event: Callable[[str, str], None],
        blind: Callable[[], None],
        backoff_s: float,
    ):
        self.name, self._connect, self._prefix = name, connect, prefix
        self._event, self._blind, self._backoff_s = event, blind, backoff_s
        self._closing = threading.Event()
        self._client: redis.Redis | None = None
        self._pubsub = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Subscribe, then follow on a thread; raises StorageError where the server will not notify."""
        self._subscribe()
        self._thread = threading.Thread(target=self._run, name="hcache-redis-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * _WAIT_S)
        self._drop()

    def _subscribe(self) -> None:
        client = self._connect()
        try:
            flags = client.config_get(SETTING).get(SETTING, "")
            missing = "".join(f for f in FLAGS if f not in flags.replace("A", _ALL))
            if missing:
                client.config_set(SETTING, flags + missing)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            db = client.connection_pool.connection_kwargs.get("db", 0)
            pattern = f"__keyspace@{db}__:{self._prefix}"
            pubsub.psubscribe(_glob_escape(pattern) + "*")
        except (redis.RedisError, OSError) as exc:
            client.close()
            raise StorageError(
                f"{self.name}: its keyspace notifications cannot be followed ({exc}); "
                f"set {SETTING} to include {FLAGS} on the server"
            ) from exc
        self._client, self._pubsub, self._cut = client, pubsub, len(pattern)

    def _drop(self) -> None:
        pubsub, client, self._pubsub, self._client = self._pubsub, self._client, None, None
        for closing in (pubsub, client):
            if closing is not None:
                try:
                    closing.close()
                except (redis.RedisError, OSError):
                    pass

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                message = self._pubsub.get_message(timeout=_WAIT_S)
            except (redis.RedisError, OSError) as exc:
                if self._closing.is_set():
                    return
                log.warning("%s: lost its keyspace notifications (%s); following again when it answers", self.name, exc)
                self._drop()
                self._blind()
                self._resubscribe()
                continue
            if message is not None and message["type"] == "pmessage":
                what = message["data"].decode(errors="replace")
                if what in EVENTS:
                    self._event(message["channel"][self._cut :].decode(errors="replace"), what)

    def _resubscribe(self) -> None:
        while not self._closing.wait(max(self._backoff_s, _WAIT_S)):
            try:
                self._subscribe()
                return
            except StorageError:
                continue
