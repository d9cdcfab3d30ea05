"""Start-up time with the start-up self-check on and off, alternated, and the check's own time.

A start-up is what a user waits for before the first request. ``--through runtime`` (the default): the
model loaded from its converted directory and :class:`~hcache.serving.runtime.HCacheRuntime` built over a
fresh store. ``--through serve``: ``hcache serve`` started as a command, until it prints that it serves
(MII's model server, load balancer and REST gateway up), then stopped (SIGTERM, with no drain: ``stop_s``
is what an idle server takes past its drain to exit). With ``--in-flight N``, N long completions are in
flight through its OpenAI server when it is stopped: they get ``--shutdown-grace`` to finish, then are cut
(``cut_codes``: the error code each got), and ``stop_s`` is held against the budget, the grace and
``STOP_MARGIN_S`` (the model servers' own stop, their saved chunks written). One start, not timed, warms the page
cache and the imports first. Starts with ``self_check="off"`` and ``"on"`` alternate over ``--repeats``
rounds, so that drift in the machine hits both alike. The check's own time is measured apart on a runtime
(the difference of two noisy start-up medians can be below their noise):
:func:`~hcache.serving.self_check.self_check` run again on the started engine. ``cost`` is the check's
median time over the median start-up with it off.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from ..defaults import DEFAULT_MODEL

STOP_MARGIN_S = 5.0  # an idle machine's budget for hcache serve's stop past its drain and grace (issue 67)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--through", choices=["runtime", "serve"], default="runtime", help="the entry point started")
    parser.add_argument("--plan", default=None, help="the served plan (default: the model's default plan)")
    parser.add_argument("--repeats", type=int, default=7, help="start-ups with the check on, and as many with it off")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="with --through serve: long completions in flight through its OpenAI server when it is stopped",
    )
    parser.add_argument(
        "--shutdown-grace", type=float, default=5.0, help="with --in-flight: hcache serve's --shutdown-grace"
    )


def _start_runtime(args: argparse.Namespace, store: Path, mode: str) -> tuple[float, None]:
    from ..model.loader import load_model
    from ..serving.runtime import HCacheRuntime

    begin = time.perf_counter()
    runtime = HCacheRuntime(
        load_model(args.model), store, self_check=mode, **({} if args.plan is None else {"plan": args.plan})
    )
    took = time.perf_counter() - begin
    runtime.close()
    return took, None


def _start_serve(args: argparse.Namespace, store: Path, mode: str) -> tuple[float, float]:
    """``hcache serve`` until it says it serves, on free ports, then SIGTERM (with ``--in-flight``
    completions running): the seconds to start, and to stop; the cut completions' codes go to
    ``args.cut_codes``."""
    from ..machine.ports import free_port

    names = ("rest-port", "port", "zmq-port", "dist-port") + ("openai-port",) * bool(args.in_flight)
    ports = {f"--{name}": str(free_port()) for name in names}
    command = [
        sys.executable,
        "-m",
        "hcache",
        "serve",
        "--model",
        args.model,
        "--store-dir",
        str(store),
        "--self-check",
        mode,
        "--metrics-port",
        "0",
        "--drain-s",
        "0",
        *[a for pair in ports.items() for a in pair],
    ]
    if args.plan is not None:
        command += ["--plan", args.plan]
    if args.in_flight:
        command += ["--shutdown-grace", str(args.shutdown_grace)]
    log = store.with_suffix(".log")
    with open(log, "w") as output:
        begin = time.perf_counter()
        serve = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        while "serving; Ctrl-C stops" not in log.read_text():
            if serve.poll() is not None:
                raise SystemExit(
                    f"hcache bench startup: hcache serve exited with {serve.returncode} before serving:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.05)
        started = time.perf_counter() - begin
        replies = _in_flight(args, ports.get("--openai-port"))
    finally:
        stopping = time.perf_counter()
        serve.send_signal(signal.SIGTERM)  # as Ctrl-C; SIGINT is ignored where the bench runs in the background
        serve.wait(timeout=120)
    stopped = time.perf_counter() - stopping
    args.cut_codes += [reply.result() for reply in replies]
    return started, stopped


def _in_flight(args: argparse.Namespace, port: str | None) -> list:
    """``args.in_flight`` completions that outlast the grace, sent and running (their first token out);
    each future's result: the error code it ends with ("none": it finished)."""
    import httpx

    if not args.in_flight:
        return []
    url = f"http://localhost:{port}/v1/completions"
    while httpx.get(f"http://localhost:{port}/health").status_code != 200:
        time.sleep(0.2)
    body = {"model": args.model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def complete(running) -> str:
        with httpx.stream("POST", url, json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                running.set()
                if '"error"' in line:
                    return json.loads(line.removeprefix("data: "))["error"]["code"] or "null"
        return "none"

    pool, replies = ThreadPoolExecutor(args.in_flight), []
    for _ in range(args.in_flight):
        running = threading.Event()
        replies.append(pool.submit(complete, running))
        running.wait(120)
    pool.shutdown(wait=False)
    return replies


def run(args: argparse.Namespace) -> dict:
    from ..model.loader import load_model
    from ..resolve import self_check_methods
    from ..serving.runtime import HCacheRuntime
    from ..serving.self_check import self_check

    if args.repeats < 1:
        raise SystemExit("hcache bench startup: --repeats must be at least 1")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    start = {"runtime": _start_runtime, "serve": _start_serve}[args.through]
    starts: dict[str, list[float]] = {"off": [], "on": []}
    stops: list[float] = []
    args.cut_codes = []
    checks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hcache-bench-startup-") as tmp:
        start(args, Path(tmp) / "warm-up", "off")
        for i in tqdm(range(2 * args.repeats), desc=f"start-ups ({args.through})", unit="start"):
            mode = ("off", "on")[i % 2]
            started, stopped = start(args, Path(tmp) / str(i), mode)
            starts[mode].append(started)
            if stopped is not None:
                stops.append(stopped)
        settings = {} if args.plan is None else {"plan": args.plan}
        with HCacheRuntime(load_model(args.model), Path(tmp) / "check", self_check="on", **settings) as runtime:
            if runtime.config.disabled:
                raise SystemExit(
                    f"hcache bench startup: the self-check disabled {sorted(m.value for m in runtime.config.disabled)}"
                )
            methods = sorted(m.value for m in self_check_methods(runtime.config))
            for _ in range(args.repeats):
                begin = time.perf_counter()
                self_check(runtime.config, runtime.engine, runtime.fingerprint)
                checks.append(time.perf_counter() - begin)
    off, on, check = (statistics.median(x) for x in (starts["off"], starts["on"], checks))
    result = {
        "model": args.model,
        "through": args.through,
        "plan": args.plan or "default",
        "methods_checked": methods,
        "startup_off_s": starts["off"],
        "startup_on_s": starts["on"],
        "check_s": checks,
        "median_startup_off_s": off,
        "median_startup_on_s": on,
        "median_check_s": check,
        "cost": check / off,
        "startup_ratio_on_over_off": on / off,
        "torch_threads": torch.get_num_threads(),
        **({"stop_s": stops, "median_stop_s": statistics.median(stops)} if stops else {}),
    }
    if args.in_flight:
        result.update(
            in_flight=args.in_flight,
            shutdown_grace_s=args.shutdown_grace,
            stop_budget_s=args.shutdown_grace + STOP_MARGIN_S,
            cut_codes=args.cut_codes,
        )
    print(
        f"{args.model} through {args.through}, self-check of {'+'.join(methods) or 'nothing'} ({args.repeats} start-ups each way, alternated):"
    )
    print(f"  start-up, check off   median {off:.2f} s  ({min(starts['off']):.2f}-{max(starts['off']):.2f})")
    print(
        f"  start-up, check on    median {on:.2f} s  ({min(starts['on']):.2f}-{max(starts['on']):.2f}), {on / off:.2f}x"
    )
    print(
        f"  the check alone       median {check:.3f} s  ({min(checks):.3f}-{max(checks):.3f}): {100 * check / off:.1f}% of start-up"
    )
    if stops:
        print(
            f"  stop after SIGTERM    median {statistics.median(stops):.2f} s  ({min(stops):.2f}-{max(stops):.2f}), past a drain of 0 s"
        )
    if args.in_flight:
        print(
            f"  with {args.in_flight} in flight: budget {args.shutdown_grace + STOP_MARGIN_S:g} s (grace {args.shutdown_grace:g} s "
            f"+ {STOP_MARGIN_S:g} s); cut with codes {sorted(set(args.cut_codes))}"
        )
    return result
