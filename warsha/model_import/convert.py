"""Load a resolved source through transformers and write a plain HF model directory.

transformers dequantizes a GGUF on load but then refuses ``save_pretrained`` ("quantized with
gguf and is not serializable"): the model is rebuilt from its config (without the quantization
entry) and its state dict, which is an ordinary float model that saves, reloads and trains like
any other. The written directory is reloaded and its logits compared with the loaded source's,
so a conversion that loses a tensor (an untied head, a dropped norm) fails here, not three
stages later.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

from warsha.model_import.source import Resolved

CHECK_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "قال رسول الله صلى الله عليه وسلم: إنما الأعمال بالنيات.",
)


def file_type_name(file_type: int | None) -> str | None:
    """GGUF ``general.file_type`` as llama.cpp names it (15 -> ``Q4_K_M``)."""
    if file_type is None:
        return None
    import gguf

    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(file_type)


def assemble(src: Resolved, work: Path) -> tuple[Path, str]:
    """Concatenate a GGUF's chunks into ``work`` (hashing as it goes); the file and sha256.

    transformers reads a GGUF by directory and file name, so even a single file is copied
    next to nothing else; the copy is verified as it is written.
    """
    import hashlib

    target = work / "model.gguf"
    h = hashlib.sha256()
    with open(target, "wb") as out:
        for path in src.files:
            with open(path, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
                    out.write(block)
    digest = h.hexdigest()
    if src.expected_sha256 and digest != src.expected_sha256.lower():
        raise ValueError(
            f"source: {src.label}: sha256 of the GGUF is {digest}, expected {src.expected_sha256};"
            " the file is corrupt or not the one named (reinstall it, or fix source.sha256)"
        )
    return target, digest


def load(src: Resolved, work: Path, dtype: str) -> tuple[Any, Any, dict[str, Any]]:
    """The model (plain, serialisable), its tokenizer and what the source was."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    if src.kind == "hf":
        path = src.files[0]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(path)
        info = {"kind": "hf", "path": str(path)}
        return model, tok, info
    gguf_path, digest = assemble(src, work)
    tok = AutoTokenizer.from_pretrained(work, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf_path.name, dtype=torch.float32)
    model = rebuild(loaded).to(torch_dtype)
    info = {
        "kind": "gguf",
        "label": src.label,
        "files": [str(p) for p in src.files],
        "sha256": digest,
        "sha256_verified_against": src.expected_sha256,
        "bytes": gguf_path.stat().st_size,
        "architecture": src.architecture,
        "dequantized_from": file_type_name(src.file_type),
        "dequantized_to": dtype,
    }
    info["rebuild_max_abs_logit_diff"] = max_logit_diff(loaded, model, tok)
    return model, tok, info


def rebuild(loaded: Any) -> Any:
    """A fresh model of the same class and config (minus the GGUF quantization entry) holding
    ``loaded``'s tensors; ties are re-established by the fresh model's own ``tie_weights``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    fresh = AutoModelForCausalLM.from_config(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or {})
    real_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise RuntimeError(f"rebuild: tensors missing {real_missing[:5]} / unexpected {unexpected[:5]}")
    fresh.tie_weights()
    fresh.generation_config = copy.deepcopy(loaded.generation_config)
    return fresh.eval()


def max_logit_diff(a: Any, b: Any, tok: Any) -> float:
    """Largest absolute logit difference between two models over :data:`CHECK_TEXTS`."""
    import torch

    worst = 0.0
    with torch.inference_mode():
        for text in CHECK_TEXTS:
            ids = tok(text, return_tensors="pt")["input_ids"]
            la, lb = a(input_ids=ids).logits.float(), b(input_ids=ids).logits.float()
            worst = max(worst, (la - lb).abs().max().item())
    return worst


def write(src: Resolved, out_dir: Path, dtype: str) -> dict[str, Any]:
    """Load, rebuild, save and re-check; the metrics for the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".import-", dir=out_dir.parent) as tmp:
        model, tok, info = load(src, Path(tmp), dtype)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dtype)).eval()
    retok = AutoTokenizer.from_pretrained(out_dir)
    ids_same = all(tok(t)["input_ids"] == retok(t)["input_ids"] for t in CHECK_TEXTS)
    cfg = model.config
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return {
        "source": info,
        "model_type": cfg.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": cfg.vocab_size,
        "tokenizer_size": len(retok),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "embeddings_shared": emb.data_ptr() == head.data_ptr(),
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "max_position_embeddings": cfg.max_position_embeddings,
        "reload_max_abs_logit_diff": max_logit_diff(model, reloaded, tok),
        "tokenizer_reload_same_ids": ids_same,
    }
