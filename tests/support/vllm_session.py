"""A conversation through ``vllm.LLM``, in phases, each a vLLM engine of its own (with hcache's connector
or without), as a user runs it: ``python vllm_session.py SPEC.json OUT.json``.

SPEC: ``model``, ``dtype``, ``turns`` ({name: [previous turn, text]}: a turn's prompt is the previous
turn's prompt, the first phase's reply to it, and its own text), ``max_tokens``, and ``phases``: each with
``connector`` (hcache's settings, ``kv_connector_extra_config``, or null for vLLM alone), ``before`` (a list
of actions: ``"corrupt DIR"``: flip a byte in the tensors of every chunk file under DIR; ``"truncate DIR"``:
cut 100 bytes off every chunk file under DIR; ``"delete DIR N"``: wait
until N chunk files are written under DIR, then delete them all; ``"stop_redis"``), ``prefix_cache`` (vLLM's
own, off by default), ``block_size`` (vLLM's KV block; 128 tokens by default on a CPU), ``tp`` (vLLM's
``tensor_parallel_size``, one process a rank, each bound to CPUs of its own), and ``requests``:
[[turn, cache_salt, actions...]] served in order, each request after its actions; ``["batch", [[turn,
cache_salt], ...]]`` sends those requests in one ``generate`` call, to run concurrently. ``"$REDIS"`` in a connector's settings is the
URL of a redis-server this script starts.
OUT: ``tokens``: per phase, each request's generated token ids; ``logprobs``: the log-probability of each.
"""
import json
import os
import sys
import time
from pathlib import Path


def run_session(spec: dict, directory: Path) -> dict:
    """This script run on ``spec`` in a process of its own, as a test runs it (vLLM's engines start processes
    of their own, and this one exits between sessions): its OUT. Fails with the script's output's tail."""
    import subprocess

    (directory / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, __file__, str(directory / "spec.json"), str(directory / "out.json")],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads((directory / "out.json").read_text())


def logprobs_close(replies: list[list[float]], reference: list[list[float]]) -> bool:
    """Replies' log-probabilities, token by token, equal to the reference's within float32 rounding."""
    return len(replies) == len(reference) and all(
        len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0.0) < 1e-4 for a, b in zip(replies, reference)
    )


def _llm(model: str, dtype: str, connector: dict | None, prefix_cache: bool, block_size: int | None, tp: int):
    from vllm import LLM

    from hcache.bench.vllm import ranks_bound
    from hcache.vllm import kv_transfer_config

    kv = kv_transfer_config(connector) if connector is not None else None
    parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    with ranks_bound(tp):
        return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=512 << 20,  # quicker to make than a share of memory
                   enable_prefix_caching=prefix_cache, kv_transfer_config=kv, **({"block_size": block_size} if block_size else {}), **parallel)  # fmt: skip


def _corrupt(directory: str) -> None:
    for path in Path(directory).glob("chunks/*/*.safetensors"):
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
        _corrupt(args[0])
    elif verb == "truncate":
        _truncate(args[0])
    elif verb == "delete":
        _delete(args[0], int(args[1]))
    elif verb == "stop_redis":
        redis.stop()
    else:
        raise ValueError(f"unknown action {action!r}")


def main() -> None:
    from vllm import SamplingParams

    from hcache.storage.redis_server import RedisServer

    spec = json.loads(Path(sys.argv[1]).read_text())
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True, logprobs=0)
    redis = RedisServer().start() if "$REDIS" in json.dumps(spec) else None
    prompts: dict[str, list[int]] = {}
    replies: dict[str, list[int]] = {}  # the first phase's, which later turns' prompts continue
    results, logprobs = [], []
    try:
        for phase in spec["phases"]:
            for action in phase.get("before", []):
                _act(action, redis)
            connector = json.loads(json.dumps(phase["connector"]).replace("$REDIS", redis.url if redis else ""))
            llm = _llm(spec["model"], spec["dtype"], connector, phase.get("prefix_cache", False), phase.get("block_size"), phase.get("tp", 1))
            out, probs = [], []
            for turn, salt, *actions in phase["requests"]:
                for action in actions:
                    _act(action, redis)
                batch = salt if turn == "batch" else [[turn, salt]]  # a batch: [[turn, salt], ...] sent at once
                for name, _ in batch:
                    if name not in prompts:
                        previous, text = spec["turns"][name]
                        head = prompts[previous] + replies[previous] if previous else []
                        prompts[name] = head + llm.get_tokenizer().encode(text, add_special_tokens=False)
                requests = [{"prompt_token_ids": prompts[name], **({"cache_salt": s} if s else {})} for name, s in batch]
                for (name, _), output in zip(batch, llm.generate(requests, params, use_tqdm=False)):
                    tokens = list(output.outputs[0].token_ids)
                    replies.setdefault(name, tokens)
                    out.append(tokens)
                    probs.append([step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens)])
            llm.llm_engine.engine_core.shutdown()
            del llm
            results.append(out)
            logprobs.append(probs)
    finally:
        if redis is not None:
            redis.close()
    Path(sys.argv[2]).write_text(json.dumps({"tokens": results, "logprobs": logprobs}))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
