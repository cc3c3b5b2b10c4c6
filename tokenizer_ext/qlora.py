"""QLoRA adaptation: NF4 base through bitsandbytes, LoRA on every linear layer through peft.

Only the new vocabulary rows of the embedding and LM head train (peft
``trainable_token_indices``), so the base vocabulary's rows, and with them the base model's
behaviour on text without the new pieces, stay as they were; ``full_embeddings`` trains the
whole matrices instead (``modules_to_save``), the base rows optionally at a lower learning rate
(``row_lr``). The artifact is a plain HF model: the adapter is
merged into the unquantized weights, and the adapter alone is kept in a subdirectory.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` whenever it wraps or
# loads a model: a warning the user can do nothing about, once per adapter run.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

BNB_MULTIPLE = 32  # bitsandbytes 4-bit no-grad forward needs output sizes divisible by 32


def check_shapes(model_dir: Path) -> None:
    """Fail before loading when a quantized layer's output size would break bitsandbytes."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    sizes = {
        "hidden_size": getattr(cfg, "hidden_size", 0),
        "intermediate_size": getattr(cfg, "intermediate_size", 0),
    }
    bad = {k: v for k, v in sizes.items() if v % BNB_MULTIPLE}
    if bad:
        raise ValueError(
            f"{model_dir}/config.json: {bad} not divisible by {BNB_MULTIPLE}; bitsandbytes 4-bit"
            " cannot run these layers; use mode full or embeddings"
        )


def load(
    model_dir: Path,
    new_ids: list[int],
    tied: bool,
    r: int,
    alpha: int,
    dropout: float,
    double_quant: bool,
    full_embeddings: bool,
    bf16: bool | None = None,
    seed: int | None = None,
    layers: list[int] | None = None,
    quantize: bool = True,
) -> Any:
    """The 4-bit base wrapped in a LoRA model with the new rows (or matrices) trainable.

    ``quantize=False`` keeps the base unquantized (float32; autocast still does bf16 math where
    it is fast): plain LoRA, whose adapter is then merged into the very weights it trained
    against. QLoRA's adapter also learns to offset the NF4 rounding of the text it sees, and
    merged into the unquantized weights that offset is an error (docs/adaptation.md).

    ``layers`` restricts LoRA to those decoder layers (all when None): tuning few layers, e.g. the
    first and last two (Yamaguchi et al. 2024), moves less of what the base knows.
    ``seed`` fixes LoRA's random initial A matrices. peft draws them from torch's global
    generator, so without it they depend on whatever the process drew before (a stage run alone
    and the same stage inside a whole recipe would start from different adapters).
    """
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from warsha.precision import compute_dtype

    if quantize:
        check_shapes(model_dir)
        dtype = compute_dtype(bf16, "auto")  # the training's choice; by default bf16 only where it is fast
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = lora_config(new_ids, tied, r, alpha, dropout, full_embeddings, layers, model)
    if seed is not None:
        torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    for q in peft_model.parameters():  # trainable weights in fp32; autocast (if bf16) does the math
        if q.requires_grad:
            q.data = q.data.float()
    return peft_model


def lora_config(
    new_ids: list[int],
    tied: bool,
    r: int,
    alpha: int,
    dropout: float,
    full_embeddings: bool,
    layers: list[int] | None = None,
    model: Any = None,
) -> Any:
    """peft's LoRA config of the adapt stage: every linear (of ``layers`` only, when given: then
    ``model`` names them), plus the new embedding/head rows (or the whole matrices with
    ``full_embeddings``). Also used on an unquantized base (the GPU check's LoRA step, where
    bitsandbytes is not installed)."""
    from peft import LoraConfig

    heads = ["embed_tokens"] if tied else ["embed_tokens", "lm_head"]
    extra: dict[str, Any] = {}
    if full_embeddings:
        extra["modules_to_save"] = heads
        # without it peft trains a copy of a tied embedding while the head keeps the original
        extra["ensure_weight_tying"] = tied
    elif new_ids:
        extra["trainable_token_indices"] = {name: list(new_ids) for name in heads}
    targets: Any = "all-linear"
    if layers is not None:  # peft takes layers_to_transform only with the modules named
        extra["layers_to_transform"] = list(layers)
        targets = decoder_linear_names(model)
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM", **extra
    )


def decoder_linear_names(model: Any) -> list[str]:
    """The names (last component) of the linear layers inside the decoder layers."""
    import torch

    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if ".layers." in n and isinstance(m, torch.nn.Linear)}
    )


def trained_embeddings(peft_model: Any) -> list[Any]:
    """The matrices ``full_embeddings`` trains (peft's copies): the embedding, and the LM head
    unless it is tied to the embedding."""
    found: dict[int, Any] = {}
    for module in (peft_model.get_input_embeddings(), peft_model.get_output_embeddings()):
        if module is not None and hasattr(module, "modules_to_save"):
            weight = module.modules_to_save["default"].weight
            found.setdefault(weight.data_ptr(), weight)  # tied: one matrix, one hook
    return list(found.values())


def trainable_count(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(q.numel() for q in model.parameters())
    return sum(q.numel() for q in model.parameters() if q.requires_grad), total


def save_and_merge(peft_model: Any, model_dir: Path, adapter_dir: Path) -> Any:
    """Save the adapter, then merge it into the unquantized base: a plain HF model (fp32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model.save_pretrained(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    return merged
