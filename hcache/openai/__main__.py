"""``python -m hcache.openai``: the OpenAI-compatible server of one deployment, a process of its own that
``hcache serve`` starts beside the deployment (:func:`hcache.mii.processes.openai_server`).

Signals from ``hcache serve``: with ``--starting`` ``/health`` answers 503 until READY_SIGNAL (the
deployment is up); DRAIN_SIGNAL makes it answer 503 again (the node is stopping) while requests are still
served; SIGTERM then stops it taking connections, and it exits once its requests are answered, or
``FINISH_S`` later, cutting those still running (they had the drain to finish)."""
from __future__ import annotations

import argparse
import logging
import signal

from ..mii.server_signals import DRAIN_SIGNAL, FINISH_S, READY_SIGNAL


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hcache.openai", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory (its tokenizer and config)")
    p.add_argument("--served-model-name", action="append", default=None, help="a name clients use for the model (repeat; the first is listed; default: --model)")
    p.add_argument("--max-model-len", type=int, default=None, help="the deployment's longest sequence (default: the model's max positions)")
    p.add_argument("--load-balancer", required=True, metavar="HOST:PORT", help="the deployment's gRPC load balancer")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--starting", action="store_true", help="the deployment is starting: /health answers 503 until READY_SIGNAL")
    p.add_argument("-v", "--verbose", action="store_true", help="log each request")
    args = p.parse_args(argv)

    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    from .app import Health, Served, create_app

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    health = Health()
    signal.signal(READY_SIGNAL, lambda *_: health.ready.set())
    signal.signal(DRAIN_SIGNAL, lambda *_: health.draining.set())
    if not args.starting:
        health.ready.set()
    max_model_len = args.max_model_len or AutoConfig.from_pretrained(args.model).max_position_embeddings
    served = Served(args.served_model_name or [args.model], AutoTokenizer.from_pretrained(args.model), max_model_len)
    app = create_app(served, args.load_balancer, health)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                timeout_graceful_shutdown=FINISH_S)  # fmt: skip


if __name__ == "__main__":
    main()
