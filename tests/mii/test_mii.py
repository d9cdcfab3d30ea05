"""DeepSpeed-MII's own code path over hcache on the CPU: ``mii.pipeline``, and ``mii.serve`` over HTTP (MII's
REST gateway, and hcache's OpenAI-compatible server in front of it), with SmolLM2 on the reference engine. A returning
conversation is restored instead of recomputed, and the replies equal those of MII with hcache off."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer

import hcache.mii
import hcache.mii.deployment
from hcache.machine import process_tree
from hcache.machine.ports import free_port as _free_port
from hcache.cli import main
from hcache.errors import InvalidRequestError, UnsupportedModelError
from hcache.config import HCacheConfig
from hcache.mii.engine_factory import resolve_deployment
from hcache.mii.processes import openai_server
from hcache.model.loader import model_dir as resolve_model_dir
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.plan import default_plan
from hcache.planning.profile import Profile, ProfileMismatch, default_profile_path
from hcache.storage.chunk_key import LAYOUT_VERSION
from support import FAULT_DIR, REPO, SUPPORT
from support.storage_chunks import chunk_bytes

NOTE = (
    "Paris is the capital and largest city of France, on the Seine. Berlin is the capital and largest city of "
    "Germany, on the Spree. Paris has about two million inhabitants in the city proper; Berlin has about three "
    "and a half million, which makes it the most populous city of the European Union. "
)
QUESTIONS = [NOTE + "What is the capital of France?", "And of Germany?", "Which of the two cities is bigger?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(smollm2) -> str:
    return str(resolve_model_dir("smollm2"))


def converse(model_dir: str, reply) -> list[str]:
    """A chat in SmolLM2's template, each turn resending the whole history, as chat clients do."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages, replies = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        replies.append(reply(prompt, messages))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def _pipeline_chat(model_dir: str, hcache_config: dict) -> list[str]:
    pipe = hcache.mii.pipeline(model_dir, hcache=hcache_config, zmq_port_number=_free_port())
    try:
        return converse(
            model_dir, lambda prompt, _: pipe([prompt], max_new_tokens=NEW_TOKENS, do_sample=False)[0].generated_text
        )
    finally:
        pipe.inference_engine.close()
        pipe.destroy()


@pytest.fixture(scope="module")
def hcache_off(model_dir) -> list[str]:
    """The replies of MII over the same engine with hcache off: the reference."""
    return _pipeline_chat(model_dir, {"enabled": False, "engine": "reference"})


def _turns(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _prompt_tokens(model_dir: str, replies: list[str]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages, lengths = [], []
    for question, reply in zip(QUESTIONS, replies):
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lengths.append(len(tokenizer.encode(prompt)))  # as MII tokenizes it
        messages.append({"role": "assistant", "content": reply})
    return lengths


def _check_restored_and_identical(model_dir: str, replies: list[str], reference: list[str], log) -> None:
    """Replies equal hcache off's, and each later turn restores at least every full chunk of the previous
    turn's prompt (a prefix of its own), which the previous turn stored."""
    assert replies == reference
    turns = _turns(log)[: len(QUESTIONS)]  # later lines: the caller's further requests
    assert len(turns) == len(QUESTIONS)
    assert turns[0]["restored_tokens"] == 0
    for turn, previous_prompt in zip(turns[1:], _prompt_tokens(model_dir, replies)):
        assert turn["restored_tokens"] >= previous_prompt // 64 * 64 > 0
        assert turn["fallback"] is None


@pytest.mark.slow
def test_pipeline_restores_returning_conversation(model_dir, hcache_off, tmp_path):
    log = tmp_path / "requests.jsonl"
    replies = _pipeline_chat(
        model_dir, {"engine": "reference", "store_dirs": [str(tmp_path / "store")], "request_log": str(log)}
    )
    _check_restored_and_identical(model_dir, replies, hcache_off, log)


FAULT_WORD = " xylophone"  # its first token makes the engine's forward raise (tests/support/fault_injection)


def _fault_token(model_dir: str) -> int:
    return AutoTokenizer.from_pretrained(model_dir).encode(FAULT_WORD)[0]


@pytest.mark.slow
def test_pipeline_call_that_fails_in_the_loop_fails_alone(model_dir, tmp_path, monkeypatch):
    """A forward that raises inside MII's loop fails its call with a clear error; the pipeline serves on."""
    from support.fault_injection.sitecustomize import faulty

    from hcache.engine.reference import ReferenceEngine
    from hcache.mii.failures import RequestFailed

    monkeypatch.setattr(ReferenceEngine, "step", faulty(ReferenceEngine.step, _fault_token(model_dir)))
    pipe = hcache.mii.pipeline(
        model_dir, hcache={"engine": "reference", "store_dirs": [str(tmp_path / "store")]}, zmq_port_number=_free_port()
    )
    try:
        before = pipe([QUESTIONS[0]], max_new_tokens=4, do_sample=False)[0].generated_text
        with pytest.raises(RequestFailed, match="injected fault"):
            pipe([QUESTIONS[0], "I play the" + FAULT_WORD], max_new_tokens=4, do_sample=False)
        assert pipe([QUESTIONS[0]], max_new_tokens=4, do_sample=False)[0].generated_text == before
    finally:
        pipe.inference_engine.close()
        pipe.destroy()


@pytest.mark.slow
def test_a_request_waiting_in_miis_buffer_prefetches_its_stored_chunks(model_dir, tmp_path):
    """With one sequence at a time, the second prompt of a call waits in MII's buffer while the first runs:
    its stored chunks (on disk, out of the host pool) start loading then, and the replies equal separate
    calls'."""
    pipe = hcache.mii.pipeline(
        model_dir,
        hcache={"engine": "reference", "store_dirs": [str(tmp_path / "store")]},
        zmq_port_number=_free_port(),
        inference_engine_config={"state_manager": {"max_ragged_sequence_count": 1}},
    )
    try:
        prompts = [QUESTIONS[0], 2 * NOTE + "Which city is on the Spree?"]
        alone = [pipe([p], max_new_tokens=4, do_sample=False)[0].generated_text for p in prompts]
        engine = pipe.inference_engine
        engine.stack.store.flush()
        engine.stack.store.drop_resident()
        assert [r.generated_text for r in pipe(prompts, max_new_tokens=4, do_sample=False)] == alone
        assert engine.metrics.snapshot()["hcache_prefetched_chunks_total"] >= 2
    finally:
        pipe.inference_engine.close()
        pipe.destroy()


def _post(url: str, body: object) -> object:
    status, answer = _post_status(url, body)
    assert status == 200, answer
    return answer


def _post_status(url: str, body: object) -> tuple[int, object]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait_for(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, "the OpenAI-compatible server exited"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (IPv4 and IPv6, as /proc lists them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


# 127.0.0.1, ::1 and ::ffff:127.0.0.1, as /proc/net writes them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
BAD_REST_BODIES = [
    ({"prompts": [""], "max_new_tokens": 4}, "empty prompt"),
    ({"prompts": "a string", "max_new_tokens": 4}, "non-empty list of strings"),
    ({"prompts": [3], "max_new_tokens": 4}, "non-empty list of strings"),
    ({"max_new_tokens": 4}, 'missing field "prompts"'),
    ({"prompts": ["Hi"], "max_new_tokens": 4, "temprature": 0.5}, "unknown field"),
    ({"prompts": ["Hi"], "max_new_tokens": -5}, "at least 1"),
    ({"prompts": ["Hi"], "max_new_tokens": 0}, "at least 1"),
    ({"prompts": ["Hi"], "max_new_tokens": "8"}, "must be an integer"),
    ({"prompts": ["Hi"], "max_new_tokens": 10**9}, "exceeds the context length"),
    ({"prompts": ["Hi"], "max_new_tokens": 4, "cache_salt": ""}, "cache_salt must be"),
    (["Hi"], "JSON object"),
]


@pytest.mark.slow
def test_serve_restores_over_rest_and_openai_api(model_dir, hcache_off, tmp_path):
    """Turns 1 and 2 through MII's REST gateway, turn 3 through hcache's OpenAI-compatible server (greedy:
    top_k=1), all against one hcache deployment with the GPU prefix cache, after bad requests that must each
    be refused alone; then per-request namespaces (``cache_salt``) through both, and the deployment's
    Prometheus counters."""
    log, store = tmp_path / "requests.jsonl", tmp_path / "store"
    rest, balancer, zmq, metrics = _free_port(), _free_port(), _free_port(), _free_port()
    client = hcache.mii.serve(
        model_dir,
        hcache={
            "engine": "reference",
            "store_dirs": [str(store)],
            "request_log": str(log),
            "gpu_cache": True,
            "metrics_port": metrics,
        },
        deployment_name="hcache-test",
        enable_restful_api=True,
        restful_api_port=rest,
        restful_processes=1,
        port_number=balancer,
        torch_dist_port=_free_port(),
        zmq_port_number=zmq,
    )
    openai_port = _free_port()
    openai = openai_server(model_dir, balancer, openai_port)
    url, chat_url = f"http://localhost:{rest}/mii/hcache-test", f"http://localhost:{openai_port}/v1/chat/completions"
    try:
        _wait_for(f"http://localhost:{openai_port}/health", openai)
        assert _listening_addresses(balancer) and _listening_addresses(balancer) <= LOOPBACK
        assert not any(str(store) in p.read_text(errors="replace") for p in _cmdlines()), "store path on a command line"
        for body, reason in BAD_REST_BODIES:
            status, answer = _post_status(url, body)
            assert status == 400 and reason in answer["error"], (body, answer)
        with pytest.raises(grpc.RpcError) as refused:  # past the gateway: refused by the model server
            client.generate([""], max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty prompt" in refused.value.details()
        completion = {"model": model_dir, "prompt": "", "max_tokens": 4}
        status, answer = _post_status(f"http://localhost:{openai_port}/v1/completions", completion)
        assert status == 400 and "prompt is empty" in answer["error"]["message"], answer
        assert _listening_addresses(zmq) and _listening_addresses(zmq) <= LOOPBACK

        prompts = []

        def reply(prompt: str, messages: list[dict]) -> str:
            prompts.append(prompt)
            if len(messages) < len(QUESTIONS):
                body = {"prompts": [prompt], "max_new_tokens": NEW_TOKENS, "do_sample": False}
                return _post(url, body)[0]["generated_text"]
            body = {"model": model_dir, "messages": messages, "max_tokens": NEW_TOKENS, "top_k": 1}
            return _post(chat_url, body)["choices"][0]["message"]["content"]

        replies = converse(model_dir, reply)
        _check_restored_and_identical(model_dir, replies, hcache_off, log)

        # The second turn's prompt is stored in the deployment's namespace only: another tenant restores
        # nothing of it, then its own state.
        for salt in ("tenant-b", "tenant-b"):
            _post(url, {"prompts": [prompts[1]], "max_new_tokens": 1, "cache_salt": salt})
        chat = {"model": model_dir, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 1}
        assert _post_status(chat_url, {**chat, "cache_salt": 7})[0] == 400
        _post(chat_url, {**chat, "cache_salt": "tenant-c"})
        counters = urllib.request.urlopen(f"http://localhost:{metrics}/metrics", timeout=30).read().decode()
    finally:
        openai.terminate()
        openai.wait(30)
        client.terminate_server()
    extra = _turns(log)[len(QUESTIONS) :]
    assert [t["restored_tokens"] > 0 for t in extra] == [False, True, False]
    adopted = sum(t["gpu_tokens"] for t in _turns(log))
    assert adopted > 0 and f"hcache_gpu_cache_hit_tokens_total {float(adopted)}" in counters


@pytest.mark.slow
def test_serve_fails_a_request_alone_and_ctrl_c_stops_a_hung_deployment(model_dir, tmp_path):
    """``hcache serve`` with a fault injected in its engine's forward (tests/support/fault_injection): a request that
    hits it gets HTTP 500 and the reason; one batched with it is recomputed alone and answered as if alone;
    later requests are served. Then, every process of the deployment stopped (SIGSTOP: a hung server),
    Ctrl-C still ends them all."""
    rest, log, out = _free_port(), tmp_path / "requests.jsonl", tmp_path / "serve.out"
    repo = str(REPO)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([FAULT_DIR, repo]), HCACHE_TEST_FAULT_TOKEN=str(_fault_token(model_dir))
    )
    command = [
        sys.executable,
        "-m",
        "hcache",
        "serve",
        "--model",
        model_dir,
        "--engine",
        "reference",
        "--store-dir",
        str(tmp_path / "store"),
        "--request-log",
        str(log),
        "--rest-port",
        str(rest),
        "--port",
        str(_free_port()),
        "--zmq-port",
        str(_free_port()),
        "--metrics-port",
        "0",
    ]
    with open(out, "w") as output:
        serve = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    stopped = []
    try:
        deadline = time.monotonic() + 300
        while "serving; Ctrl-C stops" not in out.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(1)
        url, body = (
            f"http://localhost:{rest}/mii/hcache",
            {"prompts": [QUESTIONS[0]], "max_new_tokens": 64, "ignore_eos": True, "do_sample": False},
        )
        alone = _post(url, body)
        with ThreadPoolExecutor(1) as pool:
            batched = pool.submit(_post, url, body)
            time.sleep(1)  # it is decoding now (64 tokens take seconds): the failing prompt's first put joins its batch
            status, answer = _post_status(url, {"prompts": ["I play the" + FAULT_WORD], "max_new_tokens": 4})
            assert status == 500 and "injected fault" in answer["error"], answer
            assert batched.result(timeout=300) == alone
        assert _post(url, {"prompts": ["Hi"], "max_new_tokens": 2})[0]["generated_length"] == 2
        uids = [turn["uid"] for turn in _turns(log)]
        assert len(uids) > len(set(uids)), "the batched sequence was not recomputed alone"

        stopped = process_tree.descendants(serve.pid)
        for p in stopped:
            p.suspend()  # SIGSTOP
        serve.send_signal(signal.SIGINT)
        try:
            code = serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, out.read_text()[-3000:]
        assert not process_tree.running(stopped)
    finally:
        process_tree.kill(process_tree.running([*stopped, *process_tree.descendants(serve.pid)]))
        serve.kill()
        serve.wait()


def _cmdlines():
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and os.path.exists(f"/proc/{entry.name}/cmdline"):
            yield Path(f"/proc/{entry.name}/cmdline")


def _tiny_model(model_dir: str, path) -> str:
    """A tiny random llama with SmolLM2's tokenizer, saved where MII can load it."""
    return str(save_checkpoint(random_model("llama", vocab_size=49152), path, model_dir))


@pytest.mark.slow
def test_tensor_parallel_pipeline_equals_one_rank(model_dir, tmp_path):
    """``mii.pipeline(tensor_parallel=2)`` with hcache, as two rank processes joined over gloo: replies equal
    those of one rank with hcache off, and later turns restore. (A random llama with SmolLM2's tokenizer:
    SmolLM2's 3 KV heads do not split in two.)"""
    tiny = _tiny_model(model_dir, tmp_path / "model")
    reference = _pipeline_chat(tiny, {"enabled": False, "engine": "reference"})

    store, zmq_port = tmp_path / "store", str(_free_port())
    repo = str(REPO)
    path = os.pathsep.join(
        [repo, str(SUPPORT.parent), str(Path(__file__).parent)]
    )  # hcache; support and this module, for the rank script
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT=str(_free_port()), PYTHONPATH=path)
    ranks = [
        subprocess.Popen(
            [sys.executable, "mii_tp_rank.py", tiny, str(store), str(tmp_path / f"rank{r}.json"), zmq_port],
            cwd=SUPPORT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(2)
    ]
    try:
        assert [rank.wait(timeout=600) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            rank.kill()
    for r in range(2):
        replies = json.loads((tmp_path / f"rank{r}.json").read_text())
        _check_restored_and_identical(tiny, replies, reference, store / "requests.jsonl")
    # then one prompt twice under a cache_salt, which reaches rank 1 with MII's broadcast: new, then restored
    assert [t["restored_tokens"] > 0 for t in _turns(store / "requests.jsonl")[len(QUESTIONS) :]] == [False, True]
    assert sorted(p.name for p in store.iterdir()) == ["requests.jsonl", "tp2-rank0", "tp2-rank1"]


class _ModelConfig:
    """The fields of MII's ModelConfig that the engine factory reads."""

    def __init__(self, path, tensor_parallel=1):
        self.model_name_or_path, self.tensor_parallel = str(path), tensor_parallel
        self.inference_engine_config, self.max_length = None, None


def test_unsupported_model_type_is_named_before_mii_starts(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    monkeypatch.setattr("mii.pipeline", lambda *a, **k: pytest.fail("MII started"))
    with pytest.raises(UnsupportedModelError, match="llama"):
        hcache.mii.pipeline(str(tmp_path), hcache={"enabled": False, "engine": "reference"})


def test_fastgen_without_a_gpu_says_so(model_dir, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="FastGen needs a CUDA GPU"):
        config = resolve_deployment(HCacheConfig(enabled=False, engine="fastgen"), model_dir)
        hcache.mii.build_engine(_ModelConfig(model_dir), config)


def test_untested_mii_version_is_refused(monkeypatch, model_dir):
    monkeypatch.setattr("mii.__version__", "0.5.0")
    with pytest.raises(InvalidRequestError, match="deepspeed-mii >=0.3,<0.4"):
        hcache.mii.pipeline(model_dir, hcache={"enabled": False})


def test_bad_backend_options_are_refused():
    with pytest.raises(ValueError, match="store_dirs"):
        HCacheConfig(store_dirs=[])
    with pytest.raises(ValueError, match="engine"):
        HCacheConfig(engine="vllm")
    with pytest.raises(ValueError, match="readers"):
        HCacheConfig(readers=-1)


class _Started(Exception):
    """Raised where ``hcache.mii.serve`` would start MII's processes."""


@pytest.mark.slow
def test_auto_without_this_machines_profile_serves_the_default_plan(model_dir, tmp_path, monkeypatch, caplog, capsys):
    """The only cached profile was measured on another machine: ``mii.pipeline`` serves on the default plan, and
    so would ``hcache serve``, each with one warning; given explicitly, the profile is refused by both with
    the command that measures one here."""
    tiny = _tiny_model(model_dir, tmp_path / "model")
    monkeypatch.setenv("HCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hcache.planning.profile.machine_name", lambda: "cpu2-amd-epyc")
    spec = ModelSpec.from_config(random_model("llama", vocab_size=49152).config, torch.float32)
    seconds = {name: [0.001, 0.004] for name in ("c_token", "c_h", "c_kv", "io_h", "io_kv")}
    foreign = Profile.new(tiny, spec, [64, 256], seconds, {})
    foreign.machine_name = "cpu2-intel-xeon"
    path = default_profile_path(tiny)
    foreign.save(path)
    command = f"hcache profile --model {tiny} --dtype float32"
    caplog.set_level(logging.WARNING, logger="hcache")

    def warned_once() -> None:
        [warning] = [r for r in caplog.records if r.name.startswith("hcache")]
        assert "measured on 'cpu2-intel-xeon'" in warning.message and command in warning.message
        caplog.clear()

    log = tmp_path / "requests.jsonl"
    options = {
        "engine": "reference",
        "plan": "auto",
        "measure_profile": False,
        "store_dirs": [str(tmp_path / "store")],
        "request_log": str(log),
    }
    pipe = hcache.mii.pipeline(tiny, hcache=options, zmq_port_number=_free_port())
    try:
        assert pipe.inference_engine.config.plan == default_plan(spec)
        for _ in range(2):
            pipe([2 * NOTE], max_new_tokens=2, do_sample=False)  # over 64 tokens: a chunk to restore
    finally:
        pipe.inference_engine.close()
        pipe.destroy()
    warned_once()
    assert {step["plan"] for step in _turns(log)[1]["restores"]} == {str(default_plan(spec))}

    launched = []

    def launch(config, processes):
        launched.append(config)
        raise _Started

    monkeypatch.setattr(hcache.mii.deployment, "launching_with_hcache", launch)
    with pytest.raises(_Started):
        main(["serve", "--model", tiny, "--engine", "reference", "--plan", "auto", "--no-measure-profile"])
    assert launched[0].plan == default_plan(spec) and launched[0].profile is None  # the replicas serve the default plan
    warned_once()

    assert main(["serve", "--model", tiny, "--engine", "reference", "--profile", str(path)]) == 2
    assert (
        f"measured on 'cpu2-intel-xeon', this machine is 'cpu2-amd-epyc'; run `{command}` here"
        in capsys.readouterr().err
    )
    with pytest.raises(ProfileMismatch, match="cpu2-intel-xeon"):
        hcache.mii.pipeline(tiny, hcache={"engine": "reference", "profile": str(path)})
    assert not launched[1:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan", "3H+"], "cannot parse plan"),
        (["--profile", "nowhere.json"], "no profile at nowhere.json"),
        (["--store-dir", "/proc/hcache-store"], "chunk store /proc/hcache-store is not a writable directory"),
    ],
)
def test_serve_command_checks_its_config_before_starting_anything(model_dir, args, message, capsys, monkeypatch):
    from hcache.cli import main

    started = []
    monkeypatch.setattr("subprocess.Popen.__init__", lambda self, *a, **k: started.append(a))
    assert (
        main(
            [
                "serve",
                "--model",
                model_dir,
                "--engine",
                "reference",
                "--rest-port",
                str(_free_port()),
                "--port",
                str(_free_port()),
                *args,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert started == []


@pytest.mark.parametrize(
    "args",
    [["--plan", "3H+"], ["--stored-dtype", "int4"], ["--profile", "nowhere.json"], ["--shared", "nosuch://host"]],
)
def test_a_serve_refused_for_bad_arguments_leaves_the_store_untouched(model_dir, tmp_path, args, capsys, monkeypatch):
    """Issue 34: a command refused for a bad argument opens nothing: the store's files (chunks, manifest,
    lock) are byte for byte and time for time as they were."""
    from hcache.cli import main
    from hcache.storage.disk_store import DiskChunkStore

    store = DiskChunkStore(tmp_path / "store")
    for i in range(3):
        store.put(*chunk_bytes(i))
    store.close()

    def files() -> dict:
        return {
            str(p.relative_to(tmp_path)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(tmp_path.rglob("*"))
            if p.is_file()
        }

    before = files()
    assert sum(name.endswith(".safetensors") for name in before) == 3
    started = []
    monkeypatch.setattr("subprocess.Popen.__init__", lambda self, *a, **k: started.append(a))
    ports = ["--rest-port", str(_free_port()), "--port", str(_free_port())]
    assert (
        main(
            [
                "serve",
                "--model",
                model_dir,
                "--engine",
                "reference",
                *ports,
                "--store-dir",
                str(tmp_path / "store"),
                *args,
            ]
        )
        == 2
    )
    assert capsys.readouterr().err
    assert files() == before and started == []


def test_serve_command_refuses_a_store_it_could_not_open_before_starting_anything(
    model_dir, tmp_path, capsys, monkeypatch
):
    """Issue 25: a store directory held by another process, or of an old layout, is found by the pre-start
    check, with its reason, not after MII's start-up by a crashed server."""
    from hcache.cli import main

    held, old = tmp_path / "held", tmp_path / "old"
    old.mkdir()
    (old / "hcache-store.json").write_text(json.dumps({"layout_version": LAYOUT_VERSION - 1}))
    code = "import sys; from hcache.storage.disk_store import DiskChunkStore; store = DiskChunkStore(sys.argv[1]); print('open', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    started = []
    monkeypatch.setattr("subprocess.Popen.__init__", lambda self, *a, **k: started.append(a))
    try:
        assert holder.stdout.readline() == "open\n"
        for store_dir, message in [
            (held, f"in use by another process (pid {holder.pid})"),
            (old, f"has layout version {LAYOUT_VERSION - 1}"),
        ]:
            ports = ["--rest-port", str(_free_port()), "--port", str(_free_port())]
            assert (
                main(["serve", "--model", model_dir, "--engine", "reference", *ports, "--store-dir", str(store_dir)])
                == 2
            )
            assert message in capsys.readouterr().err
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert started == []
