"""Model forward vs transformers on the same checkpoints; RoPE math vs modeling_rope_utils."""

import json
from pathlib import Path

import pytest
import torch

from serve.config import ModelConfig
from serve.model import DecoderModel, resolve_dtype
from serve.rope import inv_freq_and_attention_factor, rope_config_from_hf
from tests.serve.conftest import hf_model, make_model

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_math_matches_transformers(name: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = ROPE_CASES[name]
    kwargs = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_theta=50000.0)
    if params:
        kwargs["rope_scaling"] = dict(params)
    hf_cfg = LlamaConfig(**kwargs)
    ours = rope_config_from_hf(json.loads(hf_cfg.to_json_string()))
    for seq_len in (None, 2048):
        kind = hf_cfg.rope_parameters["rope_type"]
        if kind == "default":
            base = hf_cfg.rope_parameters["rope_theta"]
            ref = 1.0 / (base ** (torch.arange(0, 64, 2).float() / 64)), 1.0
        else:
            ref = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", seq_len=seq_len)
        inv, attn = inv_freq_and_attention_factor(ours, 64, seq_len)
        torch.testing.assert_close(inv, ref[0].float(), rtol=1e-6, atol=0)
        assert attn == pytest.approx(float(ref[1]), rel=1e-9)


def _compare(path: Path, dtype: torch.dtype, rtol: float, n: int = 60) -> None:
    ref_model = hf_model(path, dtype)
    ours = DecoderModel.load(path, dtype)
    ids = torch.randint(3, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    got = ours.prefill_logits(ids, block_size=16)
    err = (got - ref).norm() / ref.norm()
    assert err < rtol, f"relative error {err:.2e}"
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["default", "yarn", "llama3", "dynamic", "linear"])
def test_logits_match_transformers_fp32(tmp_path: Path, name: str) -> None:
    extra = {"rope_scaling": dict(ROPE_CASES[name])} if ROPE_CASES[name] else {}
    if name == "dynamic":
        extra["max_position_embeddings"] = 32  # the 60-token prompt exceeds it, so the base stretches
    path = make_model(tmp_path / name, **extra)
    _compare(path, torch.float32, 1e-4)


def test_logits_bf16_within_2e2(tmp_path: Path) -> None:
    path = make_model(
        tmp_path / "bf16",
        dtype=torch.bfloat16,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    )
    _compare(path, torch.bfloat16, 2e-2)


def test_tied_head_sharded_checkpoint(tmp_path: Path) -> None:
    path = make_model(tmp_path / "tied", tie_word_embeddings=True, _shard="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    _compare(path, torch.float32, 1e-4)


def test_qwen2_with_qkv_bias(tmp_path: Path) -> None:
    path = make_model(tmp_path / "qwen", arch="qwen2")
    assert ModelConfig.from_dir(path).attention_bias
    _compare(path, torch.float32, 1e-4)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2"):
        DecoderModel.load(path)


def test_missing_checkpoint_and_bad_dtype(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DecoderModel.load(path)
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16x")
