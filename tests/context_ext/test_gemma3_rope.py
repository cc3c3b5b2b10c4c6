"""YaRN on Gemma 3's per-layer-type RoPE: only the full-attention layers are scaled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from context_ext import scaling
from context_ext.yarn_stage import check_written
from tests.gemma3_tiny import gemma3_config


def _written(tmp_path: Path, factor: float = 4.0) -> dict:
    cfg = gemma3_config(64).to_dict()
    out = scaling.scaled_config(cfg, "yarn", factor, original=512)
    (tmp_path / "config.json").write_text(json.dumps(out))
    return out


def test_yarn_scales_full_attention_only(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    _written(tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert hf.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    assert hf.max_position_embeddings == 2048
    emb = Gemma3RotaryEmbedding(hf)
    ref_full, ref_scale = _compute_yarn_parameters(hf, "cpu", layer_type="full_attention")
    torch.testing.assert_close(emb.full_attention_inv_freq, ref_full)
    assert emb.full_attention_attention_scaling == pytest.approx(ref_scale) and ref_scale > 1.0
    # the local layers keep plain RoPE at their own base, computed independently in float64
    dim = hf.head_dim
    local = 1.0 / 10_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    torch.testing.assert_close(emb.sliding_attention_inv_freq.double(), local, rtol=1e-6, atol=0)
    assert emb.sliding_attention_attention_scaling == 1.0
    # and the global ones differ from unscaled RoPE at the low frequencies, as YaRN interpolates them
    plain = 1.0 / 1_000_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert float(emb.full_attention_inv_freq[-1]) == pytest.approx(float(plain[-1]) / 4, rel=1e-5)


def test_stage_self_check_on_gemma3(tmp_path: Path) -> None:
    _written(tmp_path)
    check = check_written(tmp_path)
    assert check["scaled_layer_type"] == "full_attention" and check["rope_type"] == "yarn"
    assert check["unscaled_layer_types"] == {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert check["context_length"] == 2048


def test_written_gemma3_model_runs_and_refuses_double_scaling(tmp_path: Path) -> None:
    from transformers import AutoConfig, Gemma3ForCausalLM

    written = _written(tmp_path)
    model = Gemma3ForCausalLM(AutoConfig.from_pretrained(tmp_path)).eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(1, 40)[None]).logits).all()
    with pytest.raises(ValueError, match="already scaled"):
        scaling.scaled_config(written, "yarn", 2.0)


def test_per_layer_rope_without_a_global_entry_is_refused() -> None:
    cfg = gemma3_config(64).to_dict()
    cfg["rope_parameters"] = {"local": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="without a 'full_attention' entry"):
        scaling.read_state(cfg)
