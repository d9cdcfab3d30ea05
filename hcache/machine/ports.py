"""Ports for the servers hcache starts: a free one to pick, and a clear refusal of one that is taken, before
anything starts (MII's servers would log the failure and carry on as if they served)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

from ..errors import InvalidRequestError


def free_port(host: str = "127.0.0.1", also: Iterable[int] = ()) -> int:
    """A free port on ``host``, with the ports ``also`` above it free too (a balancer's next to it, a Redis
    cluster node's bus 10000 above). Picked below the ephemeral ports the system gives outgoing connections
    (a port the system handed out as free is one a connection may take before the server binds it)."""
    also = list(also)
    while True:
        port = random.randrange(*_LISTEN_PORTS)
        if all(port + d <= 65535 and _bindable(host, port + d) for d in [0, *also]):
            return port


def _listen_ports() -> tuple[int, int]:
    try:  # Linux's ephemeral range; 32768 on most systems
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    return (20000, max(ephemeral, 21000))


_LISTEN_PORTS = _listen_ports()


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_free(host: str, port: int, what: str) -> None:
    """Refuse, naming ``what`` (a flag, a server), a port that cannot be listened on. Bound as servers bind
    (``SO_REUSEADDR``), so only a listener counts as taken, not a socket closing."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise InvalidRequestError(
                f"{what}: cannot listen on {host}:{port} ({exc.strerror}); is another server there?"
            ) from None
