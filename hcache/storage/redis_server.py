"""Throwaway ``redis-server`` processes on free loopback ports: the shared store ``hcache fleet`` starts when
given no server, and the one the tests and benchmarks run against.

Each server keeps nothing on disk (no RDB, no AOF) and is stopped by its process id.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from ..errors import StorageError
from ..machine.ports import free_port

_START_S = 10.0


def redis_missing() -> str | None:
    """Why a server cannot be started here, or None."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed (Debian package redis-server; scripts/install.sh installs it as root)"
    )


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``cluster``: started as a cluster node (see :class:`RedisCluster`);
    ``options``: more of its command line (``--name value`` ...)."""

    def __init__(
        self,
        *,
        cluster: bool = False,
        maxmemory: str | None = None,
        port: int | None = None,
        options: Sequence[str] = (),
    ):
        self.port = port or free_port(also=[10000] if cluster else [])  # a cluster node's bus port too
        self.cluster, self.maxmemory, self.options = cluster, maxmemory, tuple(options)
        self._dir = tempfile.mkdtemp(prefix="hcache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        why = redis_missing()
        if why:
            raise StorageError(why)
        log = Path(self._dir) / "redis.log"
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self._dir, "--logfile", str(log)]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        args += self.options
        # A session of its own: a Ctrl-C meant for its owner (``hcache fleet``) must not end it before the nodes
        # have drained into it.
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + _START_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                    raise StorageError(f"redis-server did not start on port {self.port}: {tail}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: as a crash would) and wait for it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class RedisCluster:
    """``masters`` cluster nodes on loopback, joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, masters: int = 3):
        self.nodes = [RedisServer(cluster=True) for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=_START_S,
            )
            deadline = time.monotonic() + _START_S
            clients = [redis.Redis(port=n.port, socket_timeout=1) for n in self.nodes]
            while not all(c.cluster("info").get("cluster_state") == "ok" for c in clients):
                if time.monotonic() > deadline:
                    raise StorageError("the redis cluster did not reach state ok")
                time.sleep(0.05)
            for c in clients:
                c.close()
        except (subprocess.SubprocessError, redis.RedisError) as exc:
            self.close()
            raise StorageError(f"could not create a redis cluster: {exc}") from exc
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
