"""config.json scaling: what transformers and vLLM derive from it, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from context_ext import scaling
from context_ext.stages import YarnParams
from serve import rope
from tests.context_ext.conftest import llama_config_dict

CASES = [("yarn", False), ("linear", False), ("ntk", False), ("ntk", True)]


def _hf_rotary(cfg: dict[str, Any], tmp_path: Path) -> tuple[torch.Tensor, float, Any]:
    """Load the written config with transformers and build the model's own rotary module."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(tmp_path)
    emb = LlamaRotaryEmbedding(hf)
    return emb.inv_freq.double(), float(emb.attention_scaling), hf


def vllm_max_model_len(cfg: dict[str, Any], tokenizer_cfg: dict[str, Any]) -> int:
    """vLLM's derivation of the serving length (vllm/config/model.py, _get_and_verify_max_len)."""
    derived = float(cfg["max_position_embeddings"])
    derived = min(derived, tokenizer_cfg.get("model_max_length", derived))
    rp = cfg.get("rope_parameters") or {}
    kind = rp.get("rope_type", "default")
    factor = 1.0
    if kind not in ("su", "longrope", "llama3"):
        factor = rp.get("factor", 1.0)
        if kind == "yarn":
            derived = rp["original_max_position_embeddings"]
    return int(derived * factor)


@pytest.mark.parametrize("method,dynamic", CASES)
def test_transformers_reads_the_written_scaling(method: str, dynamic: bool, tmp_path: Path) -> None:
    base = llama_config_dict(max_pos=256)
    cfg = scaling.scaled_config(base, method, 4.0, ntk_dynamic=dynamic)  # type: ignore[arg-type]
    inv, scale, hf = _hf_rotary(cfg, tmp_path)
    head_dim = 16
    expected = {
        "yarn": rope.yarn(head_dim, 10000.0, 4.0, 256),
        "linear": rope.linear_inv_freq(head_dim, 10000.0, 4.0),
        "ntk": rope.dynamic_ntk_inv_freq(head_dim, 10000.0, 4.0, 256)
        if dynamic
        else rope.ntk_inv_freq(head_dim, 10000.0, 4.0),
    }[method]
    torch.testing.assert_close(inv, expected[0], atol=1e-6, rtol=1e-6)
    assert scale == pytest.approx(expected[1])
    assert hf.max_position_embeddings == (256 if dynamic or method == "linear" else 1024)
    torch.testing.assert_close(scaling.inv_freq_of(cfg)[0], inv, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method,dynamic", CASES)
def test_every_loader_derives_original_times_factor_once(method: str, dynamic: bool, tmp_path: Path) -> None:
    base = llama_config_dict(max_pos=256)
    cfg = scaling.scaled_config(base, method, 4.0, ntk_dynamic=dynamic)  # type: ignore[arg-type]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    scaling.write_model_dir_config(tmp_path, cfg)
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == 1024
    assert vllm_max_model_len(json.loads((tmp_path / "config.json").read_text()), tok_cfg) == 1024
    assert scaling.serving_length(cfg) == 1024
    assert "rope_scaling" not in cfg and "rope_theta" not in cfg


def test_yarn_writes_the_transformers5_layout_with_options() -> None:
    cfg = scaling.scaled_config(
        llama_config_dict(max_pos=256),
        "yarn",
        4.0,
        yarn_options={"beta_fast": 16.0, "beta_slow": None, "attention_factor": 1.2},
    )
    assert cfg["rope_parameters"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "beta_fast": 16.0,
        "attention_factor": 1.2,
    }
    assert cfg["max_position_embeddings"] == 1024


def test_factor_of_one_or_less_is_refused() -> None:
    from warsha.schema import from_dict

    for bad in (1.0, 0.5):
        problems: list[str] = []
        from_dict(YarnParams, {"factor": bad}, "stages[1].params", problems)
        assert problems == [f"stages[1].params.factor: must be > 1.0, got {bad}"]
        with pytest.raises(ValueError, match="factor: must be > 1"):
            scaling.scaled_config(llama_config_dict(), "yarn", bad)


def test_original_longer_than_target_is_refused() -> None:
    from context_ext.yarn_stage import resolve
    from warsha.schema import from_dict

    problems: list[str] = []
    from_dict(YarnParams, {"original_max_position_embeddings": 512, "target_length": 256}, "p", problems)
    assert problems == ["p.target_length: must be >= original_max_position_embeddings 512, got 256"]
    # original from the model's config (known only at run time): refused before any work
    with pytest.raises(ValueError, match="target_length: must be >= the original context 256, got 128"):
        resolve(llama_config_dict(max_pos=256), YarnParams(target_length=128))


def test_model_without_rope_is_named() -> None:
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2).to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\) has no rotary position"):
        scaling.scaled_config(cfg, "yarn", 4.0)


def test_already_scaled_is_refused_unless_composed() -> None:
    once = scaling.scaled_config(llama_config_dict(max_pos=256), "yarn", 4.0)
    with pytest.raises(ValueError, match="already scaled.*compose: true"):
        scaling.scaled_config(once, "yarn", 2.0)
    twice = scaling.scaled_config(once, "yarn", 2.0, compose=True)
    assert twice["rope_parameters"]["factor"] == 8.0
    assert twice["rope_parameters"]["original_max_position_embeddings"] == 256
    assert twice["max_position_embeddings"] == 2048
    with pytest.raises(ValueError, match="only the same method composes"):
        scaling.scaled_config(once, "linear", 2.0, compose=True)


def test_static_ntk_composes_through_its_record() -> None:
    once = scaling.scaled_config(llama_config_dict(max_pos=256), "ntk", 2.0)
    with pytest.raises(ValueError, match="already scaled"):
        scaling.scaled_config(once, "ntk", 2.0)
    twice = scaling.scaled_config(once, "ntk", 2.0, compose=True)
    direct = scaling.scaled_config(llama_config_dict(max_pos=256), "ntk", 4.0)
    assert twice["rope_parameters"]["rope_theta"] == pytest.approx(direct["rope_parameters"]["rope_theta"])


def test_foreign_scaled_checkpoint_is_refused() -> None:
    """A legacy rope_scaling written by another tool counts as scaled too."""
    cfg = llama_config_dict(max_pos=4096)
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    cfg["rope_theta"] = 10000.0
    with pytest.raises(ValueError, match="rope_type 'linear', factor 4"):
        scaling.scaled_config(cfg, "yarn", 2.0)
    llama3 = llama_config_dict(max_pos=8192)
    llama3["rope_parameters"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "rope_theta": 5e5,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    with pytest.raises(ValueError, match="scaled by 'llama3'"):
        scaling.scaled_config(llama3, "yarn", 2.0, compose=True)
