"""hcache's patches of MII, DeepSpeed, grpc, zmq and torch.cuda (hcache/mii/patches.py): the registry undoes
what it sets, in reverse, leaving nothing behind; and a real deployment, once closed, leaves every attribute
the registry patches as it found it."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

import hcache.mii
from hcache.config import HCacheConfig
from hcache.errors import InvalidRequestError
from hcache.mii import patches
from hcache.mii.engine_factory import resolve_deployment
from hcache.mii.patches import ABSENT, EVERY, Patch, Patches, Shared
from test_mii import _free_port, _tiny_model


def _attributes() -> dict[str, object]:
    """What each patched owner holds itself of each name the registry patches (ABSENT where it holds none)."""
    return {str(p): vars(p.target()).get(p.name, ABSENT) for p in EVERY}


def _changed(before: dict[str, object]) -> set[str]:
    return {name for name, value in _attributes().items() if value is not before[name]}


def _hcache_made(value: object) -> bool:
    return (getattr(value, "__module__", None) or "").startswith("hcache.")


def _labels(*groups) -> set[str]:
    return {str(p) for group in groups for p in group}


@pytest.fixture(scope="module")
def tiny(smollm2, tmp_path_factory) -> str:
    from hcache.model.loader import model_dir

    return _tiny_model(str(model_dir("smollm2")), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def untouched() -> dict[str, object]:
    """Every attribute the registry patches, as found: none of hcache's (no earlier test left one)."""
    found = _attributes()
    assert not [name for name, value in found.items() if _hcache_made(value)]
    return found


@pytest.mark.slow
def test_a_closed_pipeline_leaves_every_patched_attribute_as_it_found_it(tiny, tmp_path, untouched):
    pipe = hcache.mii.pipeline(
        tiny, hcache={"engine": "reference", "store_dirs": [str(tmp_path / "store")]}, zmq_port_number=_free_port()
    )
    try:
        assert type(pipe.inference_engine).__name__ == "ServingEngine"  # built while the install was in effect
        assert _hcache_made(type(pipe).put) and _hcache_made(type(pipe).__call__)  # its loop kept on its own class
        assert _changed(untouched) == _labels(patches.REQUEST_CLASSES)  # held while it lives
        with pytest.raises(InvalidRequestError, match="max_new_tokens must be at least 1"):  # the checks still run
            pipe(["Paris"], max_new_tokens=0)
        assert pipe(["Paris is"], max_new_tokens=2, do_sample=False)[0].generated_length == 2
    finally:
        pipe.inference_engine.close()
        pipe.destroy()
    assert _changed(untouched) == set()


@pytest.mark.slow
def test_two_pipelines_share_the_namespaces_broadcast_until_both_are_destroyed(tiny, tmp_path, untouched):
    options = {"enabled": False, "engine": "reference"}
    first = hcache.mii.pipeline(tiny, hcache=options, zmq_port_number=_free_port())
    second = hcache.mii.pipeline(tiny, hcache=options, zmq_port_number=_free_port())
    first.destroy()
    with pytest.raises(AttributeError):  # MII's destroy fails a second time, after which the hold is not released again
        first.destroy()
    assert _changed(untouched) == _labels(patches.REQUEST_CLASSES)
    second.destroy()
    assert _changed(untouched) == set()


def test_a_server_process_undoes_every_patch_when_its_server_returns(tiny, untouched):
    config = resolve_deployment(HCacheConfig(enabled=False, engine="reference"), tiny)
    model_config = SimpleNamespace(model_name_or_path=tiny, tokenizer=None, max_length=None)
    with patches.install_server(config, model_config, rest_gateway=True):
        on_cpu = () if torch.cuda.is_available() else patches.ON_CPU
        server = (
            patches.ENGINE,
            on_cpu,
            patches.CHECKS,
            patches.DETOKENIZING,
            patches.FAILURES,
            patches.LOOPBACK,
            patches.REQUEST_CLASSES,
            patches.MODEL_SERVER,
            patches.REST_GATEWAY,
        )
        assert _changed(untouched) == _labels(*server)
    assert _changed(untouched) == set()


def test_starting_a_deployment_undoes_the_launch_patches(untouched):
    with patches.launching_with_hcache(SimpleNamespace(model_dump_json=lambda: "{}"), []):
        assert _changed(untouched) == _labels(patches.LAUNCHING)
    assert _changed(untouched) == set()


class _Base:
    def method(self):
        return "base"


class _Owner(_Base):
    def own(self):
        return "own"


def test_patches_are_undone_together_in_reverse_leaving_nothing_behind(monkeypatch):
    module = types.ModuleType("hcache_test_owner")
    module.Owner, module.value = _Owner, 1
    monkeypatch.setitem(sys.modules, module.__name__, module)
    own, inherited = vars(_Owner)["own"], vars(_Base)["method"]
    group = (
        Patch("hcache_test_owner:Owner", "own", lambda original, suffix: lambda self: original(self) + suffix),
        Patch(
            "hcache_test_owner:Owner", "own", lambda original, suffix: lambda self: f"[{original(self)}]"
        ),  # wraps the first
        Patch(
            "hcache_test_owner:Owner", "method", lambda original, suffix: lambda self: "patched"
        ),  # inherited, not _Owner's
        Patch("hcache_test_owner", "value", lambda original, suffix: original + 1),
        Patch("hcache_test_owner", "added", lambda original, suffix: "new"),  # absent until patched
    )
    applied = Patches().install(group, "!")
    assert (_Owner().own(), _Owner().method(), module.value, module.added) == ("[own!]", "patched", 2, "new")
    applied.undo()
    assert vars(_Owner)["own"] is own and "method" not in vars(_Owner) and _Owner.method is inherited
    assert module.value == 1 and not hasattr(module, "added") and not applied.saved
    applied.undo()  # harmless
    assert vars(_Owner)["own"] is own and module.value == 1

    def failing(original, suffix):
        raise RuntimeError("cannot make it")

    with pytest.raises(RuntimeError, match="cannot make it"):
        Patches().install((*group, Patch("hcache_test_owner", "value", failing)), "!")
    assert (
        vars(_Owner)["own"] is own
        and "method" not in vars(_Owner)
        and module.value == 1
        and not hasattr(module, "added")
    )


def test_a_shared_group_is_installed_while_anything_holds_it(monkeypatch):
    module = types.ModuleType("hcache_test_owner")
    module.value = 1
    monkeypatch.setitem(sys.modules, module.__name__, module)
    shared = Shared((Patch("hcache_test_owner", "value", lambda original: original + 1),))
    first, second = Patches().hold(shared), Patches().hold(shared)
    assert module.value == 2  # installed once
    first.undo()
    first.undo()  # released once only
    assert module.value == 2
    second.undo()
    assert module.value == 1
