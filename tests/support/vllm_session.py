"""A conversation through ``vllm.LLM``, in phases, each a vLLM engine of its own (with hcache's connector
or without), as a user runs it: ``python vllm_session.py SPEC.json OUT.json``.

SPEC: ``model``, ``dtype``, ``engine_args`` (more of ``vllm.LLM``'s arguments, for every phase: an MLA
model's ``attention_backend``, say, or ``kv_events_config`` as a dict; a phase's own ``engine_args`` add to
them), ``turns`` ({name: [previous turn, text]}: a turn's prompt is the
previous turn's prompt, the first phase's reply to it, and its own text), ``max_tokens``, and ``phases``:
each with
``connector`` (hcache's settings, ``kv_connector_extra_config``, or null for vLLM alone), ``before`` (a list
of actions: ``"corrupt DIR"``: flip a byte in the tensors of every chunk file under DIR (``"corrupt DIR
largest"``: of the largest ones, a recurrent state's); ``"truncate DIR"``:
cut 100 bytes off every chunk file under DIR; ``"delete DIR N"``: wait
until N chunk files are written under DIR, then delete them all; ``"stop_redis"``; ``"sleep S"``), ``prefix_cache`` (vLLM's
own, off by default), ``block_size`` (vLLM's KV block; 128 tokens by default on a CPU), ``tp`` (vLLM's
``tensor_parallel_size``, one process a rank, each bound to CPUs of its own), ``reserved_cpus`` (cores
vLLM's CPU worker keeps off its OpenMP threads, ``VLLM_CPU_NUM_OF_RESERVED_CPU``; vLLM's default if
absent), ``in_process`` (true: the engine's core and its worker run in this process, as
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor run them, TP=1 only: the engine then starts in
a few seconds, not the 40-50 s its two fresh interpreters importing vLLM take on a 2-core machine; a
connector's scheduler and worker sides share this process, its load process still its own; a key of the
spec too, the phases' default), and ``requests``:
[[turn, cache_salt, actions...]] served in order, each request after its actions; ``["batch", [[turn,
cache_salt], ...]]`` sends those requests in one ``generate`` call, to run concurrently; ``["steps",
DECODERS, JOINING]`` (each ``[[turn, cache_salt], ...]``) steps the engine one step at a time (:func:`_steps`):
DECODERS decode, and JOINING join them a few steps in. ``"$REDIS"`` in a connector's settings is the URL of a
redis-server this script starts.
OUT: ``tokens``: per phase, each request's generated token ids (a ``steps`` request's: JOINING's);
``logprobs``: the log-probability of each; ``steps``: per phase, its ``steps`` request's steps, or null;
``prompts``: each turn's prompt token ids.

The tests run their sessions through :func:`run_session`, in one process of this script for them all
(``--serve``), which imports vLLM once.
"""

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path


SESSION_S = 1800  # a loaded 2-core machine takes minutes an engine; an idle one, seconds


class _Server:
    """This script in ``--serve`` mode: one process that runs the suite's sessions one after another, so that
    vLLM is imported once (13 s on a 2-core machine), not once a session. Its output goes to a log file, read
    back where a session fails; a session that fails ends the process (an engine of it may still be alive),
    and the next one starts another."""

    def __init__(self):
        import subprocess
        import tempfile

        fd, name = tempfile.mkstemp(prefix="hcache-vllm-sessions-", suffix=".log")
        self.log = Path(name)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
            )

    def run(self, spec: Path, out: Path, status: Path) -> str | None:
        """Run the session of ``spec`` (its OUT to ``out``): None, or why it failed with the output's tail."""
        begin = self.log.stat().st_size
        self.process.stdin.write((json.dumps([str(spec), str(out), str(status)]) + "\n").encode())
        self.process.stdin.flush()
        deadline = time.monotonic() + SESSION_S
        while not status.exists() and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        error = json.loads(status.read_text())["error"] if status.exists() else None
        if status.exists() and error is None:
            return None
        hung, tail = self.process.poll() is None and not status.exists(), self._tail(begin)
        self.close(wait=0 if hung else 60)  # a failed session ends the process; a hung one is killed
        if status.exists():
            return f"{tail}\n{error}"
        return f"the session process {'timed out' if hung else f'ended (exit code {self.process.returncode})'}:\n{tail}"

    def _tail(self, begin: int) -> str:
        with open(self.log, "rb") as log:
            log.seek(begin)
            return log.read().decode(errors="replace")[-8000:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, wait: float = 60.0) -> None:
        """End the process once it has ended its session, or after ``wait`` seconds, killed."""
        import subprocess

        if self.process.poll() is None:
            self.process.stdin.close()  # the loop ends at its input's end
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.unlink(missing_ok=True)


_server: _Server | None = None


def run_session(spec: dict, directory: Path) -> dict:
    """``spec``'s session run in the suite's session process (:class:`_Server`, started on first use and
    ended as the tests end), as this script runs it from the command line: its OUT. Fails with the output's
    tail."""
    import atexit

    global _server
    if _server is None or not _server.alive():
        _server = _Server()
        atexit.register(_server.close)
    (directory / "spec.json").write_text(json.dumps(spec))
    failed = _server.run(directory / "spec.json", directory / "out.json", directory / "status.json")
    assert failed is None, failed
    return json.loads((directory / "out.json").read_text())


def logprobs_close(replies: list[list[float]], reference: list[list[float]]) -> bool:
    """Replies' log-probabilities, token by token, equal to the reference's within float32 rounding."""
    return len(replies) == len(reference) and all(
        len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0.0) < 1e-4
        for a, b in zip(replies, reference)
    )


def _transfer_config(connector: dict, wait: float = 60.0) -> dict:
    """hcache's ``kv_transfer_config`` for ``connector``, once the last phase's engine has let its store go:
    ``shutdown()`` returns before that engine's processes end, and the store's lock ends with them (a busy
    machine once started the next phase first, which refused the store as in use)."""
    from hcache.errors import InvalidRequestError
    from hcache.vllm import kv_transfer_config

    deadline = time.monotonic() + wait
    while True:
        try:
            return kv_transfer_config(connector)
        except InvalidRequestError as exc:
            if "in use by another process" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _llm(
    model: str,
    dtype: str,
    connector: dict | None,
    prefix_cache: bool,
    block_size: int | None,
    tp: int,
    reserved: int | None = None,
    in_process: bool = False,
    engine_args: dict | None = None,
):
    from vllm import LLM, envs
    from vllm.config import KVEventsConfig

    from hcache.bench.vllm import ranks_bound

    engine_args = dict(engine_args or {})
    if isinstance(engine_args.get("kv_events_config"), dict):  # vLLM's LLM takes only its config object
        engine_args["kv_events_config"] = KVEventsConfig(**engine_args["kv_events_config"])

    kv = _transfer_config(connector) if connector is not None else None
    parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    if in_process:
        assert tp == 1, "an engine in this process runs one rank"
        parallel = {"distributed_executor_backend": "uni"}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    envs.disable_envs_cache()  # an engine in this process caches vLLM's settings (this one among them) as it starts
    with ranks_bound(tp), _reserved_cpus(reserved):
        return LLM(
            model=model,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=2048,
            kv_cache_memory_bytes=512 << 20,  # quicker to make than a share of memory
            enable_prefix_caching=prefix_cache,
            kv_transfer_config=kv,
            **({"block_size": block_size} if block_size else {}),
            **engine_args,
            **parallel,
        )


@contextlib.contextmanager
def _reserved_cpus(count: int | None):
    """While an engine starts: vLLM's CPU worker keeps ``count`` cores off its OpenMP threads, for its
    other processes and hcache's helpers (None: vLLM's default, which on two cores keeps none)."""
    if count is None:
        yield
        return
    before = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(count)
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
        else:
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = before


STEPS_ALONE = 6  # the decoders' steps timed before the joining requests arrive, and after they have left


def _steps(llm, decoders: list[dict], joining: list[dict], params) -> tuple[list, list[dict]]:
    """:func:`_stepping`, with the machine's cores to itself (``support/cores.py``: under pytest-xdist, no other
    worker's test runs meanwhile), from before the decoders are added: an engine core in a process of its
    own decodes them on its own while this process waits. Taken after, the wait let the decoders run on, their
    outputs then read in steps of no time, until the KV cache was full and vLLM preempted a joining request."""
    from cores import alone  # this script's directory leads its path

    with alone():
        return _stepping(llm, decoders, joining, params)


def _stepping(llm, decoders: list[dict], joining: list[dict], params) -> tuple[list, list[dict]]:
    """``decoders`` decoding, stepped to their first tokens; then one step at a time: STEPS_ALONE steps, then
    ``joining`` added and stepped until every one of them has replied, then STEPS_ALONE steps again. Returns
    the joining requests' outputs, and each timed step: its seconds (``s``), how many decoders it gave a
    token (``decoders``), and how many joining requests had no token yet when it ended (``waiting``: held
    back while they load, or computing in it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE  # an output each step: ``generate`` leaves ``params`` FINAL_ONLY
    base = lambda out: out.request_id.split("-")[0]  # noqa: E731  vLLM may suffix "-..." to an id
    decoding = [f"decoder{i}" for i in range(len(decoders))]
    for rid, request in zip(decoding, decoders):
        engine.add_request(rid, request, SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0))
    started: set[str] = set()
    while len(started) < len(decoding):
        started |= {base(out) for out in engine.step() if out.outputs[0].token_ids}
    steps, replies = [], {}

    def step(waiting: set[str], timed: bool = True) -> None:
        began = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - began
        for out in outs:
            waiting.discard(base(out))
            if out.finished and base(out).startswith("joining"):
                replies[base(out)] = out
        if timed:
            steps.append({"s": took, "decoders": sum(base(out) in started for out in outs), "waiting": len(waiting)})

    for _ in range(STEPS_ALONE):
        step(set())
    names = [f"joining{j}" for j in range(len(joining))]
    for rid, request in zip(names, joining):
        engine.add_request(rid, request, params)
    waiting = set(names)
    while waiting:
        step(waiting)
    while len(replies) < len(joining):  # their replies, decoded beside the decoders: not timed
        step(set(), timed=False)
    for _ in range(STEPS_ALONE):
        step(set())
    engine.abort_request(decoding)
    while engine.has_unfinished_requests():
        engine.step()
    return [replies[f"joining{j}"] for j in range(len(joining))], steps


def _drain(llm) -> None:
    """In this process, the steps vLLM's engine-core process runs after ``generate`` has its outputs, while its
    scheduler holds finished requests: they hand the connector's worker those requests, which it then
    closes (publishing their chunks, logging their records). ``generate`` alone leaves them to the next
    request's first step, and the last ones to none."""
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_requests():
        llm.llm_engine.step()


def _corrupt(directory: str, which: str = "all") -> None:
    """``which``: "all" the chunk files, or "largest": those of the largest size (a recurrent layer's state
    makes a chunk larger)."""
    paths = list(Path(directory).glob("chunks/*/*.safetensors"))
    if which == "largest":
        largest = max(path.stat().st_size for path in paths)
        paths = [path for path in paths if path.stat().st_size == largest]
    for path in paths:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # in the last tensor's rows: the header still parses, the checksum fails
        path.write_bytes(bytes(data))


def _truncate(directory: str) -> None:
    for path in Path(directory).glob("chunks/*/*.safetensors"):
        path.write_bytes(path.read_bytes()[:-100])  # shorter than its header says: dropped when the store opens


def _delete(directory: str, count: int) -> None:
    """Once ``count`` chunk files are written (the write-back runs behind the requests), delete them all."""
    deadline = time.monotonic() + 60
    while len(files := list(Path(directory).glob("chunks/*/*.safetensors"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(files)} of {count} chunk files written under {directory}")
        time.sleep(0.05)
    for path in files:
        path.unlink()


def _act(action: str, redis) -> None:
    verb, *args = action.split(" ")
    if verb == "corrupt":
        _corrupt(*args)
    elif verb == "truncate":
        _truncate(args[0])
    elif verb == "delete":
        _delete(args[0], int(args[1]))
    elif verb == "stop_redis":
        redis.stop()
    elif verb == "sleep":
        time.sleep(float(args[0]))
    else:
        raise ValueError(f"unknown action {action!r}")


def session(spec: dict) -> dict:
    """Run ``spec``'s phases: its OUT."""
    from vllm import SamplingParams

    from hcache.storage.redis_server import RedisServer

    cpus = os.sched_getaffinity(0)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True, logprobs=0)
    redis = RedisServer().start() if "$REDIS" in json.dumps(spec) else None
    prompts: dict[str, list[int]] = {}
    replies: dict[str, list[int]] = {}  # the first phase's, which later turns' prompts continue
    results, logprobs, timed = [], [], []
    try:
        for phase in spec["phases"]:
            for action in phase.get("before", []):
                _act(action, redis)
            connector = json.loads(json.dumps(phase["connector"]).replace("$REDIS", redis.url if redis else ""))
            in_process = phase.get("in_process", spec.get("in_process", False))
            llm = _llm(
                spec["model"],
                spec["dtype"],
                connector,
                phase.get("prefix_cache", False),
                phase.get("block_size"),
                phase.get("tp", 1),
                phase.get("reserved_cpus"),
                in_process,
                engine_args={**spec.get("engine_args", {}), **phase.get("engine_args", {})},
            )
            out, probs, steps = [], [], None
            for turn, salt, *actions in phase["requests"]:
                decoders = []
                if turn == "steps":  # ["steps", decoders, joining]
                    decoders, salt, actions = salt, actions[0], actions[1:]
                for action in actions:
                    _act(action, redis)
                batch = (
                    salt if turn in ("batch", "steps") else [[turn, salt]]
                )  # a batch: [[turn, salt], ...] sent at once
                for name, _ in decoders + batch:
                    if name not in prompts:
                        previous, text = spec["turns"][name]
                        head = prompts[previous] + replies[previous] if previous else []
                        prompts[name] = head + llm.get_tokenizer().encode(text, add_special_tokens=False)
                request = lambda name, s: {"prompt_token_ids": prompts[name], **({"cache_salt": s} if s else {})}  # noqa: E731
                requests = [request(name, s) for name, s in batch]
                if turn == "steps":
                    outputs, steps = _steps(llm, [request(name, s) for name, s in decoders], requests, params)
                else:
                    outputs = llm.generate(requests, params, use_tqdm=False)
                    if in_process:
                        _drain(llm)
                for (name, _), output in zip(batch, outputs):
                    tokens = list(output.outputs[0].token_ids)
                    replies.setdefault(name, tokens)
                    out.append(tokens)
                    probs.append([step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens)])
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()  # in this process, an engine's last references (and its store's lock) go with it
            os.sched_setaffinity(0, cpus)  # an engine in this process bound this thread to its OpenMP cores
            results.append(out)
            logprobs.append(probs)
            timed.append(steps)
    finally:
        if redis is not None:
            redis.close()
    return {"tokens": results, "logprobs": logprobs, "steps": timed, "prompts": prompts}


def serve() -> None:
    """Sessions named on stdin, a line each (``[SPEC, OUT, STATUS]``), run in turn; STATUS says, once OUT is
    written, whether the session failed and how (JSON ``{"error": null | traceback}``). A failed session ends
    the loop."""
    import traceback

    def told(status: str, error: str | None) -> None:  # whole or not at all: the test reads it as it appears
        Path(status + ".part").write_text(json.dumps({"error": error}))
        os.replace(status + ".part", status)

    for line in sys.stdin:
        spec, out, status = json.loads(line)
        try:
            Path(out).write_text(json.dumps(session(json.loads(Path(spec).read_text()))))
        except BaseException:
            told(status, traceback.format_exc())
            raise
        told(status, None)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        Path(sys.argv[2]).write_text(json.dumps(session(json.loads(Path(sys.argv[1]).read_text()))))
