"""A fleet on one machine: N ``hcache serve`` nodes behind HAProxy, one Redis server below them all
(:mod:`.nodes`), run by ``hcache fleet`` (:mod:`.command`)."""

from .nodes import Fleet, Node, Reply, chat, haproxy_missing

__all__ = ["Fleet", "Node", "Reply", "chat", "haproxy_missing"]
