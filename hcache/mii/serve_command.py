"""``hcache serve``: a DeepSpeed-MII deployment with the hcache backend, with MII's REST gateway and,
optionally, MII's OpenAI-compatible server in front of it, until interrupted."""
from __future__ import annotations

import argparse
import sys
import time

from ..model_loader import DEFAULT_MODEL, model_dir
from ..storage.store_config import StoreConfig
from . import serve
from .backend import openai_server
from .config import HCacheConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model with DeepSpeed-MII and hcache (REST, optionally OpenAI API)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default) or a HF model directory")
    p.add_argument("--store-dir", action="append", default=None, help="chunk store directory (repeat for each SSD; default: hcache-store)")
    p.add_argument("--tier", action="append", default=[], metavar="URL",
                   help="a store shared with other replicas, below the local directory (repeat; nearest first): "
                   "redis://host:port/db, redis+cluster://host:port,host:port, or a directory on a shared filesystem")
    p.add_argument("--plan", default=None, help="auto, RE, H, KV or counts like 2RE+20H+8KV (default: H for MHA models, KV where KV is smaller)")
    p.add_argument("--profile", default=None, help="a profile from `hcache profile` (implies --plan auto); refused if measured elsewhere")
    p.add_argument("--no-measure-profile", dest="measure_profile", action="store_false",
                   help="with --plan auto and no profile for this machine, serve the default plan instead of measuring one first")
    p.add_argument("--engine", default="auto", choices=["auto", "fastgen", "reference"], help="auto: FastGen on a GPU, else the reference engine")
    p.add_argument("--off", action="store_true", help="serve without hcache (the recompute baseline)")
    p.add_argument("--gpu-cache", action="store_true", help="keep finished sequences' KV in spare KV blocks and reuse it (a GPU prefix cache)")
    p.add_argument("--metrics-port", type=int, default=9464, help="serve Prometheus counters on this port, on --host (default 9464; 0: off)")
    p.add_argument("--request-log", default=None, help="append one JSON line per finished sequence to this file")
    p.add_argument("--deployment-name", default="hcache", help="the REST path is /mii/<deployment-name>")
    p.add_argument("--host", default="localhost", help="the address the REST gateway and the OpenAI server listen on (default: localhost; 0.0.0.0 for every interface)")
    p.add_argument("--rest-port", type=int, default=51080, help="MII's REST gateway port")
    p.add_argument("--port", type=int, default=50050, help="MII's load balancer (gRPC) port")
    p.add_argument("--openai-port", type=int, default=None, help="also start MII's OpenAI-compatible server on this port")


def run(args: argparse.Namespace) -> int:
    path = str(model_dir(args.model))
    config = HCacheConfig(
        enabled=not args.off,
        engine=args.engine,
        store_dirs=args.store_dir or ["hcache-store"],
        store=StoreConfig(tiers=tuple(args.tier)),
        plan=args.plan,
        profile=args.profile,
        measure_profile=args.measure_profile,
        request_log=args.request_log,
        gpu_cache=args.gpu_cache,
        metrics_port=args.metrics_port or None,
        metrics_host=args.host,
    )
    client = serve(
        path,
        hcache=config,
        deployment_name=args.deployment_name,
        enable_restful_api=True,
        restful_api_host=args.host,
        restful_api_port=args.rest_port,
        port_number=args.port,
    )
    openai = None
    try:
        print(f"REST: POST http://{args.host}:{args.rest_port}/mii/{args.deployment_name}  {{\"prompts\": [...], \"max_new_tokens\": N}}")
        if args.openai_port is not None:
            openai = openai_server(path, args.port, args.openai_port, args.host)
            print(f"OpenAI API: http://{args.host}:{args.openai_port}/v1/chat/completions  (model: {path})")
        if args.metrics_port:
            print(f"Prometheus metrics: http://{args.host}:{args.metrics_port}/metrics")
        print("serving; Ctrl-C stops", flush=True)
        while openai is None or openai.poll() is None:
            time.sleep(1)
        print("hcache: the OpenAI-compatible server exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if openai is not None:
            openai.terminate()
            openai.wait(30)
        client.terminate_server()
