"""Settings typed and checked once, when they are made, each bad one refused with one line before anything
starts (issue 67): shared stores by their URL's scheme, no empty directory names, quotas and TTLs positive
whole numbers, one namespace rule for the settings and a request, and messages that echo a bounded part
of what they were given."""

import json
import math
import socket
from pathlib import Path

import pytest

from hcache import cli
from hcache.config import HCacheConfig
from hcache.errors import HCacheError, InvalidRequestError, StorageError
from hcache.machine.ports import free_port
from hcache.mii import deployment
from hcache.storage.chunk_key import check_namespace
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.redis_store import RedisChunkStore
from hcache.storage.store_config import SharedDirectory, StoreConfig, shared_store

MISSPELT_URLS = [
    "redis//127.0.0.1:6379/0",  # a colon left out: once ./redis/127.0.0.1:6379/0/
    "127.0.0.1:6379",  # no scheme: once ./127.0.0.1:6379/
    "",  # once the current directory
    "file://relative/dir",  # 'relative' is the URL's host: once /dir
    "relative/dir",
    "redsi://127.0.0.1:6379/0",
    "http://127.0.0.1/x",
]


def _serve(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``hcache serve`` with ``argv``: its exit code and what it printed, failing if it got as far as starting
    a deployment."""
    monkeypatch.setattr(deployment, "serve", lambda *a, **kw: pytest.fail("a deployment was started"))
    code = cli.main(["serve", *argv])
    return code, capsys.readouterr().err.strip()


def test_a_kv_events_port_that_is_taken_is_refused_before_a_deployment_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")  # the model directory
    ports = [arg for flag in ("--port", "--zmq-port", "--rest-port") for arg in (flag, str(free_port()))]
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = tmp_path / "settings.json"
        settings.write_text(json.dumps({"kv_events": {"endpoint": f"tcp://*:{port}"}}))
        argv = ["--model", str(tmp_path), "--config", str(settings), "--engine", "reference", "--metrics-port", "0"]
        code, err = _serve(argv + ports, monkeypatch, capsys)
    assert code == 2 and err == f"hcache: error: kv_events.endpoint: cannot listen on 0.0.0.0:{port} " + (
        "(Address already in use); is another server there?"
    )


@pytest.mark.parametrize("url", MISSPELT_URLS)
def test_a_shared_store_url_that_is_neither_a_store_nor_clearly_a_path_is_refused(url, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for make in (lambda: StoreConfig(shared=(url,)), lambda: HCacheConfig.of(store={"shared": [url]})):
        with pytest.raises(StorageError, match="unknown shared store") as refused:
            make()
        assert "\n" not in str(refused.value)
    code, err = _serve(["--shared", url], monkeypatch, capsys)
    assert code == 2 and "unknown shared store" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # no directory made of it


def test_a_misspelt_redis_url_is_refused_without_its_password():
    with pytest.raises(StorageError) as refused:
        shared_store("redis//admin:hunter2@10.0.0.5:6379/0")
    assert "hunter2" not in str(refused.value) and "admin:***@" in str(refused.value)


def test_a_shared_directory_is_an_absolute_path_a_clearly_relative_one_or_a_file_url():
    for url, path in [
        ("/mnt/shared/hc", "/mnt/shared/hc"),
        ("./shared", "shared"),
        ("../shared", "../shared"),
        ("~/shared", str(Path.home() / "shared")),
        ("file:///mnt/shared/hc", "/mnt/shared/hc"),
        ("file://localhost/mnt/shared/hc", "/mnt/shared/hc"),
    ]:
        store = shared_store(url)
        assert isinstance(store, SharedDirectory) and store.path == Path(path), url


@pytest.mark.parametrize("dirs", ["", [""], ["/nvme0/hc", ""]])
def test_an_empty_store_directory_name_is_refused(dirs):
    with pytest.raises(InvalidRequestError, match="a store directory is named ''") as refused:
        HCacheConfig.of(store_dirs=dirs)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["quota_bytes", "ttl_s", "host_bytes", "writers"])
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, 1.5, "100000000", True])
def test_sizes_and_times_are_positive_whole_numbers(name, value):
    """Once ``quota_bytes='100000000'`` raised a raw TypeError when the store opened, NaN turned the quota
    off and 0 was refused only by the store, in the model server."""
    with pytest.raises(StorageError, match=f"store.{name} must be a positive whole number") as refused:
        StoreConfig(**{name: value})
    assert "\n" not in str(refused.value)
    if (
        not isinstance(value, (str, bool)) and value is not None
    ):  # from a file, pydantic takes "5" as 5, as it does any setting
        with pytest.raises(HCacheError, match=name):
            HCacheConfig.of(store={name: value})


def test_hcache_serve_refuses_a_zero_quota_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    config = tmp_path / "hcache.json"
    config.write_text(json.dumps({"store": {"quota_bytes": 0}}))
    code, err = _serve(["--config", str(config)], monkeypatch, capsys)
    assert code == 2 and err == "hcache: error: store.quota_bytes must be a positive whole number, not 0"


def test_stores_refuse_a_quota_or_ttl_that_is_not_finite(tmp_path):
    for option in ({"quota_bytes": math.nan}, {"quota_bytes": math.inf}, {"ttl_s": math.nan}):
        with pytest.raises(StorageError, match="positive and finite"):
            DiskChunkStore(tmp_path, **option)
    for query in ("ttl=nan", "ttl=inf", "timeout=nan", "backoff=inf"):
        with pytest.raises(StorageError, match="finite"):
            RedisChunkStore.from_url(f"redis://127.0.0.1:6379/0?{query}")


@pytest.mark.parametrize(
    "namespace", [b"tenant", "", "a\nb", 5, "x" * 10_000], ids=["bytes", "empty", "newline", "int", "long"]
)
def test_the_namespace_rule_is_the_same_for_the_settings_as_for_a_request(namespace):
    """``namespace=b'a'`` was coerced by the settings, though a request's is refused; and a 10,000-character
    one was echoed whole (10,197 characters). The settings' message is the request's, at most 80
    characters of the value echoed in each."""
    with pytest.raises(InvalidRequestError) as request:
        check_namespace(namespace, "namespace")
    with pytest.raises(InvalidRequestError) as settings:
        HCacheConfig.of(namespace=namespace)
    assert str(request.value) in str(settings.value) and len(str(settings.value)) < 300
