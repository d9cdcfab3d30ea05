"""``hcache serve``: a DeepSpeed-MII deployment with the hcache backend, with MII's REST gateway and,
optionally, MII's OpenAI-compatible server in front of it, until interrupted.

SIGTERM or Ctrl-C drains the node: its OpenAI server's ``/health`` answers 503 at once, so a load balancer
stops sending it requests, while requests are still served; ``--drain-s`` later the server answers new
requests 503 and gives those in flight ``--shutdown-grace`` to finish, ending the rest with an error
(:mod:`hcache.openai.shutdown`); then the deployment stops, and each model server writes every chunk it
saved to its stores before it exits."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import DEFAULT_MODEL
from ..errors import InvalidRequestError
from ..machine.owner import owning
from ..machine.ports import check_free
from .processes import DEFAULT_SHUTDOWN_GRACE_S, DRAIN_SIGNAL, FINISH_S, READY_SIGNAL

if TYPE_CHECKING:
    from ..config import HCacheConfig  # imported where it is used: it imports torch

DEFAULT_METRICS_PORT = 9464
DRAIN_S = 3.0  # a health check every second, two failures to take a node out (hcache/fleet/haproxy.cfg), and margin


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model with DeepSpeed-MII and hcache (REST, optionally OpenAI API)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default) or a HF model directory")
    p.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help="hcache settings as a JSON file (the fields of hcache.HCacheConfig, as for hcache.mii); "
        "the flags below override it",
    )
    p.add_argument(
        "--store-dir",
        action="append",
        default=None,
        help="chunk store directory (repeat for each SSD; default: hcache-store)",
    )
    p.add_argument(
        "--shared",
        action="append",
        default=None,
        metavar="URL",
        help="a store shared with other replicas, below the local directory (repeat; nearest first): "
        "redis://host:port/db, redis+cluster://host:port,host:port, or a directory on a shared filesystem "
        "(file:///dir, or a path starting with /, ./, ../ or ~)",
    )
    p.add_argument("--tier", action="append", default=None, help=argparse.SUPPRESS)  # --shared's former name
    p.add_argument(
        "--plan",
        default=None,
        help="auto, RE, H, KV or counts like 2RE+20H+8KV (default: H for MHA models, KV where KV is smaller)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="a profile from `hcache profile` (implies --plan auto); refused if measured elsewhere",
    )
    p.add_argument(
        "--no-measure-profile",
        dest="measure_profile",
        action="store_false",
        default=None,
        help="with --plan auto and no profile for this machine, serve the default plan instead of measuring one first",
    )
    p.add_argument(
        "--stored-dtype",
        default=None,
        metavar="DTYPE",
        help="how saved state is stored: auto (the model's dtype, lossless; default), int8, fp8, 8bit "
        "(fp8 H, int8 KV) or per format like H=fp8,KV=int8",
    )
    p.add_argument(
        "--engine",
        default=None,
        choices=["auto", "fastgen", "reference"],
        help="auto (default): FastGen on a GPU, else the reference engine",
    )
    p.add_argument(
        "--off",
        dest="enabled",
        action="store_false",
        default=None,
        help="serve without hcache (the recompute baseline)",
    )
    p.add_argument(
        "--gpu-cache",
        action="store_true",
        default=None,
        help="keep finished sequences' KV in spare KV blocks and reuse it (a GPU prefix cache)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"serve Prometheus counters on this port, on --host (default {DEFAULT_METRICS_PORT}; 0: off)",
    )
    p.add_argument("--request-log", default=None, help="append one JSON line per finished sequence to this file")
    p.add_argument(
        "--self-check",
        default=None,
        choices=["on", "strict", "off"],
        help="before serving, restore a short random history by each method the plan may use and compare it with "
        "recompute: on (default) disables a method that fails, strict refuses to start, off skips the check",
    )
    p.add_argument("--deployment-name", default="hcache", help="the REST path is /mii/<deployment-name>")
    p.add_argument(
        "--host",
        default="localhost",
        help="the address the REST gateway and the OpenAI server listen on "
        "(default: localhost; 0.0.0.0 for every interface)",
    )
    p.add_argument("--rest-port", type=int, default=51080, help="MII's REST gateway port")
    p.add_argument(
        "--no-rest",
        dest="rest",
        action="store_false",
        help="no REST gateway: the OpenAI API alone (with --openai-port)",
    )
    p.add_argument("--port", type=int, default=50050, help="MII's load balancer (gRPC) port")
    p.add_argument(
        "--openai-port", type=int, default=None, help="also start MII's OpenAI-compatible server on this port"
    )
    p.add_argument(
        "--zmq-port", type=int, default=25555, help="MII's port for broadcasting a batch to its ranks (loopback)"
    )
    p.add_argument("--dist-port", type=int, default=29500, help="torch.distributed's port for the ranks (loopback)")
    p.add_argument(
        "--drain-s",
        type=float,
        default=DRAIN_S,
        help="on SIGTERM, seconds /health answers 503 while requests are still taken, so that a balancer "
        f"moves away (default {DRAIN_S})",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metavar="SECONDS",
        help="after the drain, new requests are answered 503 and those in flight get this long to finish before they "
        f"are ended with an error (default {DEFAULT_SHUTDOWN_GRACE_S:g})",
    )


def settings(args: argparse.Namespace) -> HCacheConfig:
    """The settings of ``--config`` (if given) with the flags given on top, validated."""
    from ..config import HCacheConfig  # imports torch: here, so that `hcache serve --help` does not

    base = {"metrics_port": DEFAULT_METRICS_PORT}
    if args.config is not None:
        try:
            given = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"--config {args.config}: not a readable JSON file ({exc})") from None
        if not isinstance(given, dict):
            raise InvalidRequestError(
                f"--config {args.config}: expected a JSON object of hcache settings, not {type(given).__name__}"
            )
        base.update(given)
    flags = {
        "enabled": args.enabled,
        "engine": args.engine,
        "store_dirs": args.store_dir,
        "plan": args.plan,
        "profile": args.profile,
        "measure_profile": args.measure_profile,
        "request_log": args.request_log,
        "gpu_cache": args.gpu_cache,
        "metrics_host": args.host,
        "stored_dtype": args.stored_dtype,
        "self_check": args.self_check,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    if args.metrics_port is not None:
        given["metrics_port"] = args.metrics_port or None  # 0: off
    if args.tier is not None:
        print("hcache serve: --tier is now called --shared; --tier will be refused in a later release", file=sys.stderr)
    shared = (args.shared or []) + (args.tier or [])
    if shared:
        given["store"] = {**dict(base.get("store") or {}), "shared": shared}
    return HCacheConfig.of(base, **given)


def run(args: argparse.Namespace) -> int:
    from ..model.loader import model_dir

    config = settings(args)
    path = str(model_dir(args.model))
    with owning():  # every server it starts ends with it, however it ends
        return _serve(args, config, path)


def _serve(args: argparse.Namespace, config: HCacheConfig, path: str) -> int:
    """The deployment of ``path`` (and the OpenAI server, where asked for) until stopped."""
    from .deployment import serve
    from .engine_factory import context_length
    from .processes import openai_server

    for flag, (host, port) in _ports(args, config).items():
        check_free(host, port, flag)
    openai = client = None

    def start_openai(resolved) -> None:  # once the settings are checked; it starts while the deployment does
        nonlocal openai
        if args.openai_port is not None:  # healthy once the deployment is up
            names = list(dict.fromkeys([args.model, path]))  # as given on the command line, and its directory
            openai = openai_server(
                path,
                args.port,
                args.openai_port,
                args.host,
                max_model_len=context_length(resolved),
                names=names,
                starting=True,
                shutdown_grace=args.shutdown_grace,
                verbose=getattr(args, "verbose", False),
            )

    on_sigterm = signal.signal(
        signal.SIGTERM, signal.default_int_handler
    )  # stop as on Ctrl-C (by default SIGTERM ends only this process)
    try:
        client = serve(
            path,
            hcache=config,
            checked=start_openai,
            deployment_name=args.deployment_name,
            enable_restful_api=args.rest,
            restful_api_host=args.host,
            restful_api_port=args.rest_port,
            port_number=args.port,
            zmq_port_number=args.zmq_port,
            torch_dist_port=args.dist_port,
        )
        if args.rest:
            print(
                f"REST: POST http://{args.host}:{args.rest_port}/mii/{args.deployment_name}  "
                '{"prompts": [...], "max_new_tokens": N}'
            )
        if openai is not None:
            _signal_when_listening(openai, args.host, args.openai_port, READY_SIGNAL)
            print(f"OpenAI API: http://{args.host}:{args.openai_port}/v1/chat/completions  (model: {args.model})")
        if config.metrics_port:
            print(f"Prometheus metrics: http://{args.host}:{config.metrics_port}/metrics")
        print("serving; Ctrl-C stops", flush=True)
        while openai is None or openai.poll() is None:
            time.sleep(1)
        print("hcache: the OpenAI-compatible server exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if client is not None and openai is not None and openai.poll() is None:
            _drain(openai, args.drain_s)
        return 0
    finally:
        with signals_ignored(signal.SIGINT, signal.SIGTERM):
            if openai is not None:
                # new requests are refused; those in flight get the grace to finish (hcache.openai.shutdown)
                openai.terminate()
                try:
                    openai.wait(args.shutdown_grace + FINISH_S + 5)
                except subprocess.TimeoutExpired:
                    openai.kill()
                    openai.wait()
            if client is not None:
                client.terminate_server()
        signal.signal(signal.SIGTERM, on_sigterm)


def _ports(args: argparse.Namespace, config: HCacheConfig) -> dict[str, tuple[str, int]]:
    """Every port the deployment will listen on, by the flag that sets it: (address, port)."""
    ports = {
        "--port": ("localhost", args.port),
        "--port + 1 (the model server)": ("localhost", args.port + 1),
        "--zmq-port": ("127.0.0.1", args.zmq_port),
    }
    if args.rest:
        ports["--rest-port"] = (args.host, args.rest_port)
    if args.openai_port is not None:
        ports["--openai-port"] = (args.host, args.openai_port)
    if config.metrics_port:
        ports["--metrics-port"] = (args.host, config.metrics_port)
    if config.published_events is not None:
        ports.update({f"kv_events.{name}": at for name, at in config.published_events.listens().items()})
    return ports


@contextmanager
def signals_ignored(*signals: int) -> Iterator[None]:
    """Ignore ``signals`` inside (a second Ctrl-C must not cut a stop short), restoring their handlers after:
    a process that starts children later must not pass them an ignored SIGINT."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _signal_when_listening(openai: subprocess.Popen, host: str, port: int, sig: int) -> None:
    """Send ``sig`` to the OpenAI server once it listens (it handles the signal by then; before, the
    signal would end it)."""
    while openai.poll() is None:
        try:
            socket.create_connection((host, port), timeout=1).close()
            openai.send_signal(sig)
            return
        except OSError:
            time.sleep(0.2)


def _drain(openai: subprocess.Popen, seconds: float) -> None:
    """Fail the OpenAI server's health check and keep serving ``seconds``, so the balancer takes the node
    out of rotation before it stops taking connections."""
    print(f"draining: /health answers 503; stopping in {seconds:g} s", flush=True)
    openai.send_signal(DRAIN_SIGNAL)
    time.sleep(seconds)
