"""Group sizes checked when a recipe is planned, said once per pattern; ``group_size: auto``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quantize.arch import arch_for
from quantize.shapes import fitting_group_sizes, layer_span, linear_shapes, short_names, summarize
from quantize.stages import STAGES, RTNParams
from warsha.config import RecipeError, parse_recipe
from warsha.widths import Widths

SMOL = {  # SmolLM2-135M's widths: hidden 576 = 4.5 x 128
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
}
LINE = (
    "q/k/v/o/gate/up_proj in all 30 layers: in_features 576 is not a multiple of group_size 128;"
    " use group_size: 64, 32 or auto"
)


def _write_gguf(path: Path) -> Path:
    """A GGUF with only the header keys a planner reads (no tensors), as llama.cpp writes them."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(SMOL["hidden_size"])
    w.add_feed_forward_length(SMOL["intermediate_size"])
    w.add_block_count(SMOL["num_hidden_layers"])
    w.add_head_count(SMOL["num_attention_heads"])
    w.add_head_count_kv(SMOL["num_key_value_heads"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def _recipe(first: dict[str, Any], group_size: Any, **top: Any) -> dict[str, Any]:
    quant = {"stage": "quantize.awq", "params": {"group_size": group_size}}
    return {"name": "t", **top, "stages": [first, quant] if first else [quant]}


def test_import_gguf_header_widths_fail_at_planning_in_one_line(tmp_path: Path) -> None:
    src = _write_gguf(tmp_path / "smol.gguf")
    with pytest.raises(RecipeError) as err:
        parse_recipe(_recipe({"stage": "import", "params": {"source": {"path": str(src)}}}, 128))
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(f"stages[1].params.group_size: {LINE} (widths from {src}")
    parse_recipe(_recipe({"stage": "import", "params": {"source": {"path": str(src)}}}, 64))
    parse_recipe(_recipe({"stage": "import", "params": {"source": {"path": str(src)}}}, "auto"))


def test_base_config_and_bootstrap_widths_are_checked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    with pytest.raises(RecipeError, match="in all 30 layers: in_features 576"):
        parse_recipe(_recipe({}, 128, base=str(tmp_path)))
    boot = {"stage": "bootstrap", "params": {"hidden_size": 288, "intermediate_size": 768, "num_heads": 4}}
    with pytest.raises(RecipeError) as err:
        parse_recipe(_recipe(boot, 64))
    # 288 = 4.5 x 64; o_proj's input is heads x head_dim = 288 too; down_proj's 768 = 12 x 64 fits
    assert err.value.problems == [
        "stages[1].params.group_size: q/k/v/o/gate/up_proj in all 4 layers: in_features 288 is not a multiple of"
        " group_size 64; use group_size: 32 or auto (widths from bootstrap params)"
    ]


def test_draft_widths_follow_its_params() -> None:
    boot = {"stage": "bootstrap", "params": {}}
    draft = {"stage": "distill.draft", "params": {"method": "config", "hidden_size": 96, "num_heads": 4}}
    recipe = {"name": "t", "stages": [boot, draft, {"stage": "quantize.rtn", "params": {"group_size": 64}}]}
    with pytest.raises(RecipeError, match=r"stages\[2\].*in all 1 layers: in_features 96 .* draft config params"):
        parse_recipe(recipe)
    recipe["stages"][2]["inputs"] = {"model": "bootstrap"}
    parse_recipe(recipe)  # the 256-wide bootstrap model takes group 64
    recipe["stages"][2]["params"]["on_bad_group"] = "fallback"
    recipe["stages"][2]["inputs"] = {}
    parse_recipe(recipe)  # fallback keeps such linears in float: nothing to refuse


def test_summaries() -> None:
    assert short_names(["self_attn.q_proj", "mlp.up_proj"]) == "q/up_proj"
    assert short_names(["mlp.down_proj"]) == "down_proj"
    assert layer_span([0, 1, 2, 3, 7, 9, 10], 30) == "layers 0-3, 7, 9-10"
    assert layer_span([4], 30) == "layer 4"
    bad = {(i, n): "x" for i in range(3) for n in ("self_attn.k_proj", "self_attn.v_proj")} | {
        (1, "mlp.down_proj"): "y"
    }
    assert summarize(bad, 3) == ["k/v_proj in all 3 layers: x", "down_proj in layer 1: y"]
    w = Widths("llama", 576, 1536, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=30, source="t")
    shapes = linear_shapes(arch_for("llama"), w)
    assert shapes["self_attn.k_proj"] == (576, 192) and shapes["mlp.down_proj"] == (1536, 576)
    assert fitting_group_sizes(shapes.values(), 4, "gptq") == [64, 32]
    assert fitting_group_sizes([(100, 64)], 4, "gptq") == []


def test_auto_resolves_on_the_model_and_is_recorded(tmp_path: Path, corpus: Any) -> None:
    from tests.quantize.quant_fixtures import FakeContext, make_tokenizer, tiny_model

    src = tmp_path / "src"
    tok = make_tokenizer(src)
    tiny_model(vocab=len(tok), hidden=96, inter=192).save_pretrained(src)  # 96 takes 32, not 64
    ctx = FakeContext(model_dir=src, out_dir=tmp_path / "q", the_corpus=corpus)
    m = STAGES["rtn"].run(ctx, RTNParams(group_size="auto", eval_documents=4, eval_max_length=32))
    assert (m["group_size"], m["group_size_requested"]) == (32, "auto")
    assert json.loads((ctx.out_dir / "config.json").read_text())["quantization_config"]["group_size"] == 32
