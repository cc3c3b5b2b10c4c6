"""Seeded random checkpoints of every served family, built in-process from configs.

The serving tests and the GPU check (`python -m benchmarks.gpu_check`) need models that exist
without a download: a tiny byte-level BPE tokenizer, random weights in transformers' own
classes (the independent reference), a layer-skip draft of the same family, and GPTQ int4
checkpoints with their exactly dequantized twins. One definition here, used by both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "serving engines batch many requests at once",
    "paged attention keeps the kv cache in blocks",
    "مرحبا بالعالم هذا نص عربي قصير",
] * 4

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# Tiny shapes of each family, as `make_model` overrides: Mistral's window is real (16), Gemma 3
# mixes sliding and full layers with their own RoPE bases, soft-capping and a tied head.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "gemma3": dict(
        arch="gemma3",
        head_dim=32,
        num_hidden_layers=4,
        sliding_window=16,
        layer_types=GEMMA_LAYERS,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "mistral": dict(arch="mistral", sliding_window=16),
}

# TinyLlama-1.1B's shape (22 layers, 2048 wide, GQA 32/4, 32k vocabulary), random weights.
TINYLLAMA_SHAPE: dict[str, Any] = dict(
    arch="llama",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
)


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


def make_model(
    path: Path,
    seed: int = 0,
    arch: str = "llama",
    dtype: torch.dtype = torch.float32,
    init_device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Save a random tiny model (plus tokenizer) to `path` and return it.

    `overrides` are config fields (`vocab_size` beyond the tokenizer's is allowed: prompts are
    then token ids); `_damp_layers_from=i` shrinks layers i.. so a layer-skip draft agrees often;
    `init_device="cuda"` draws the weights there (a 1B model initialises in seconds)."""
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
    with torch.device(init_device):
        model = model_cls(cfg_cls(**kwargs)).to(dtype).eval()
    with torch.no_grad():  # norms start at 1 (0 for Gemma's 1 + w): random ones test that each is applied
        for name, param in model.named_parameters():
            if arch in ("qwen3", "gemma3") and name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, dtype=param.dtype, device=param.device) * 0.2)
    if damp_from is not None:  # later layers barely change the residual: a layer-skip draft agrees often
        with torch.no_grad():
            for layer in model.model.layers[damp_from:]:
                layer.self_attn.o_proj.weight.mul_(0.05)
                layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(str(path), max_shard_size=shard or "2GB")
    return path


def make_tinyllama(path: Path, dtype: torch.dtype = torch.bfloat16, init_device: str = "cpu") -> Path:
    """The TinyLlama-1.1B shape with random weights and no tokenizer: its 32k vocabulary is far
    beyond the tiny tokenizer's, so prompts are token ids (an engine without a tokenizer never
    detokenizes)."""
    make_model(path, seed=11, dtype=dtype, init_device=init_device, **TINYLLAMA_SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)
    return path


def make_layer_skip_draft(target: Path, path: Path, num_layers: int = 1) -> Path:
    """A draft made of the target's first `num_layers` layers (same embeddings, head, tokenizer)."""
    from safetensors.torch import save_file

    from serve.weights import load_state_dict

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, path / name)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_state_dict(target)  # one file or shards (a 1.1B float32 target is saved in 2 GB shards)
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def gptq_pair(base: Path, out: Path, group_size: int = 32) -> tuple[Path, Path]:
    """(GPTQ v1 int4 checkpoint of `base`, float32 checkpoint of exactly its dequantized weights).

    Every `*_proj` linear is rounded to nearest on an asymmetric 4-bit grid and packed by
    `quantize`'s own GPTQ packer; the twin holds the float32 weights those codes stand for, so
    transformers on the twin is the reference for an int4 engine."""
    from safetensors.torch import save_file

    from quantize.pack import pack_gptq
    from quantize.quantizer import QuantSpec, quantize_rtn
    from serve.weights import load_state_dict

    spec = QuantSpec(bits=4, group_size=group_size, sym=False)
    qdir, ddir = out / "q", out / "deq"
    qstate, dstate = {}, {}
    for name, tensor in load_state_dict(base).items():
        module = name[: -len(".weight")]
        if name.endswith("_proj.weight"):
            ql = quantize_rtn(tensor.float(), spec)
            qstate.update({f"{module}.{k}": v for k, v in pack_gptq(ql).items()})
            dstate[name] = ql.dequantize()
        else:
            qstate[name] = dstate[name] = tensor
    cfg = json.loads((base / "config.json").read_text())
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": False, "desc_act": False}
    for d, qc in ((ddir, None), (qdir, quant)):
        d.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (base / name).is_file():
                shutil.copy(base / name, d / name)
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    save_file(qstate, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dstate, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    return qdir, ddir


def hf_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """The transformers reference for `path` (SDPA attention), in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(device).eval()
