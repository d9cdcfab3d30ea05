"""``hcache fleet``: N ``hcache serve`` nodes behind HAProxy with a shared Redis store, on this machine, until
Ctrl-C or SIGTERM (which drain every node before the balancer and Redis stop)."""

from __future__ import annotations

import argparse
import signal
import time

from ..defaults import DEFAULT_MODEL
from ..mii.serve_command import signals_ignored
from .nodes import Fleet


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fleet", help="several hcache serve nodes behind HAProxy, with a shared Redis store, on this machine"
    )
    p.add_argument("--nodes", type=int, required=True, help="how many hcache serve nodes")
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the shared store: a running Redis (redis://host:port/db, options as for serve --shared); default: start a redis-server",
    )
    p.add_argument(
        "--port", type=int, default=8080, help="the balancer's port (default 8080); the nodes' ports are chosen free"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the balancer's address (default 127.0.0.1; 0.0.0.0 for every interface); the nodes listen on 127.0.0.1",
    )
    p.add_argument(
        "--dir",
        default="hcache-fleet",
        help="each node's store, request log and output, and HAProxy's config (default hcache-fleet)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="as for hcache serve")
    p.add_argument(
        "--config", default=None, metavar="JSON", help="hcache settings for every node, as for hcache serve --config"
    )


def run(args: argparse.Namespace) -> int:
    serve_args = ["--model", args.model, *(["--config", args.config] if args.config else [])]
    fleet = Fleet(args.nodes, args.dir, redis_url=args.redis, host=args.host, port=args.port, serve_args=serve_args)
    on_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl-C
    try:
        print(f"starting {args.nodes} node(s), HAProxy and Redis ...", flush=True)
        fleet.start()
        print(fleet.describe())
        print("serving; Ctrl-C stops (each node drains first)", flush=True)
        reported: set[str] = set()
        while any(node.alive() for node in fleet.nodes):  # the others serve a node's share when it is gone
            for node in fleet.nodes:
                if not node.alive() and node.name not in reported:
                    reported.add(node.name)
                    print(
                        f"hcache fleet: {node.name} exited (status {node.process.returncode}); see {node.output}",
                        flush=True,
                    )
            time.sleep(1)
        print("hcache fleet: every node has exited", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        with signals_ignored(signal.SIGINT, signal.SIGTERM):
            fleet.stop()
        signal.signal(signal.SIGTERM, on_sigterm)
