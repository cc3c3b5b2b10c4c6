"""Fixtures: tiny random Llama-family checkpoints and a byte-level BPE tokenizer, built in-process.

transformers is used here only as the independent reference; `serve` itself never imports it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny ops on a shared 2-core machine: extra OpenMP threads only wait on each other.
torch.set_num_threads(1)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "serving engines batch many requests at once",
    "paged attention keeps the kv cache in blocks",
    "مرحبا بالعالم هذا نص عربي قصير",
] * 4


def write_tokenizer(path: Path) -> int:
    """Train a small byte-level BPE and write tokenizer.json + tokenizer_config.json; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    return tok.get_vocab_size()


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def make_model(
    path: Path, seed: int = 0, arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Save a random tiny model (plus tokenizer) to `path` and return it."""
    import transformers

    vocab = write_tokenizer(path)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    cfg_name, model_name = ARCHS[arch]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    damp_from = kwargs.pop("_damp_layers_from", None)
    shard = kwargs.pop("_shard", None)
    model = model_cls(cfg_cls(**kwargs)).to(dtype).eval()
    with torch.no_grad():  # norms start at 1 (0 for Gemma's 1 + w): random ones test that each is applied
        for name, param in model.named_parameters():
            if arch in ("qwen3", "gemma3") and name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, dtype=param.dtype) * 0.2)
    if damp_from is not None:  # later layers barely change the residual: a layer-skip draft agrees often
        with torch.no_grad():
            for layer in model.model.layers[damp_from:]:
                layer.self_attn.o_proj.weight.mul_(0.05)
                layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(str(path), max_shard_size=shard or "2GB")
    return path


def make_layer_skip_draft(target: Path, path: Path, num_layers: int = 1) -> Path:
    """A draft made of the target's first `num_layers` layers (same embeddings, head, tokenizer)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, path / name)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(target / "model.safetensors"))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (fp32 weights)."""
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-layer target whose later layers are damped, and its 1-layer layer-skip draft."""
    target = make_model(tmp_path_factory.mktemp("spec_target"), seed=3, num_hidden_layers=3, _damp_layers_from=1)
    return target, make_layer_skip_draft(target, tmp_path_factory.mktemp("spec_draft"))


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller draft with the same tokenizer."""
    return make_model(
        tmp_path_factory.mktemp("draft"),
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers reference for `path`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
