"""``python -m hcache.openai``: the OpenAI-compatible server of one deployment, a process of its own that
``hcache serve`` starts beside the deployment (:func:`hcache.mii.processes.openai_server`).

Signals from ``hcache serve``: with ``--starting`` ``/health`` answers 503 until READY_SIGNAL (the
deployment is up); DRAIN_SIGNAL makes it answer 503 again (the node is stopping) while requests are still
served; SIGTERM then shuts it down (:mod:`.shutdown`): new requests are answered 503, those in flight get
``--shutdown-grace`` to finish and are then ended with an error, and it exits."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ..machine import process_tree
from ..machine.owner import end_with_owner
from ..mii.processes import DEFAULT_SHUTDOWN_GRACE_S, DRAIN_SIGNAL, FINISH_S, READY_SIGNAL


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hcache.openai", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory (its tokenizer and config)")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="a name clients use for the model (repeat; the first is listed; default: --model)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the deployment's longest sequence (default: the model's max positions)",
    )
    p.add_argument("--load-balancer", required=True, metavar="HOST:PORT", help="the deployment's gRPC load balancer")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--starting", action="store_true", help="the deployment is starting: /health answers 503 until READY_SIGNAL"
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metavar="SECONDS",
        help=f"on SIGTERM, how long requests in flight may take to finish (default {DEFAULT_SHUTDOWN_GRACE_S:g})",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log each request")
    args = p.parse_args(argv)

    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    from .app import Health, Served, create_app
    from .shutdown import InFlight, shut_down

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    end_with_owner()  # hcache serve's, when it started this server
    health = Health()
    signal.signal(READY_SIGNAL, lambda *_: health.ready.set())
    signal.signal(DRAIN_SIGNAL, lambda *_: health.draining.set())
    if not args.starting:
        health.ready.set()
    max_model_len = args.max_model_len or AutoConfig.from_pretrained(args.model).max_position_embeddings
    served = Served(args.served_model_name or [args.model], AutoTokenizer.from_pretrained(args.model), max_model_len)
    app = create_app(served, args.load_balancer, health)
    in_flight = InFlight(app)

    class Server(uvicorn.Server):
        started_shutdown = False

        def handle_exit(self, sig: int, frame) -> None:
            if sig != signal.SIGTERM or self.should_exit or self.started_shutdown:
                return super().handle_exit(sig, frame)  # Ctrl-C, or a second signal: uvicorn's own stop
            self.started_shutdown = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(
                loop.create_task, shut_down(self, in_flight, app.state.deployment, args.shutdown_grace, FINISH_S)
            )

    config = uvicorn.Config(
        in_flight,
        host=args.host,
        port=args.port,
        log_level="info" if args.verbose else "warning",
        access_log=args.verbose,
        timeout_graceful_shutdown=FINISH_S,
    )
    Server(config).run()
    process_tree.exit_now()  # every request answered; the server holds no state


if __name__ == "__main__":
    main()
