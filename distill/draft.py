"""Draft construction: a smaller model of the target's family sharing its exact vocabulary.

A draft is only useful if token id ``i`` means the same piece in both models: a mismatch does
not fail loudly, it garbles output or silently drops acceptance to nothing (vllm#7252,
sglang#24051, llama.cpp PR #3812). So every draft built or loaded here is checked id by id
against the target's tokenizer, and the tokenizer files are copied, never rebuilt.

Two constructions:

- ``layers``: keep a subset of the target's decoder layers, initialised from them, with the
  embeddings, final norm and LM head copied. The draft starts close to the target (its first
  layers and its head are the target's), which is the cheapest good start.
- ``config``: a smaller model of the target's own class (Llama, Qwen, Gemma 3, ...) from a config
  (hidden size, layers, heads). Weights are random, or
  ``embedding``-copied: copied as they are when the hidden size matches, else projected onto
  the top principal directions of the target's embedding and head matrices (the best rank-``d``
  linear approximation, so most of what the target's vocabulary geometry holds is kept).

Both copy the target's rope configuration (e.g. YaRN ``rope_parameters``, per layer type for
Gemma 3) and context length, so the draft sees positions the way the target does; a narrow draft
of a model with sliding and full layers ends in a full-attention layer, so it sees the whole
context as the target's global layers do.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warsha import tokenizer_files


def first_vocab_difference(target_tok: Any, draft_tok: Any) -> tuple[int, str | None, str | None] | None:
    """The first id whose piece differs between two tokenizers, with both pieces (``None``
    where an id is absent), or ``None`` when the vocabularies are identical."""
    t_inv = {i: s for s, i in target_tok.get_vocab().items()}
    d_inv = {i: s for s, i in draft_tok.get_vocab().items()}
    for i in range(max(len(t_inv), len(d_inv), max(t_inv, default=-1) + 1, max(d_inv, default=-1) + 1)):
        if t_inv.get(i) != d_inv.get(i):
            return i, t_inv.get(i), d_inv.get(i)
    return None


def assert_same_vocab(target_tok: Any, draft_tok: Any, target_cfg: Any, draft_cfg: Any) -> None:
    """Refuse a draft whose vocabulary differs from the target's, naming the first bad id."""
    diff = first_vocab_difference(target_tok, draft_tok)
    if diff is not None:
        i, t, d = diff
        raise ValueError(
            f"draft vocabulary differs from the target's at id {i}: target {t!r}, draft {d!r};"
            " speculative decoding needs identical ids (build the draft with distill.draft,"
            " which copies the target's tokenizer)"
        )
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        i = min(target_cfg.vocab_size, draft_cfg.vocab_size)
        raise ValueError(
            f"draft vocabulary differs from the target's at id {i}: the target's embedding has"
            f" {target_cfg.vocab_size} rows, the draft's {draft_cfg.vocab_size}"
        )


def check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Validate a layer subset (indices into the target, negatives from the end allowed)."""
    bad = [i for i in layers if not -num_layers <= i < num_layers]
    if bad:
        raise ValueError(
            f"layers: {bad} do not exist; the target has {num_layers} layers (valid indices 0..{num_layers - 1})"
        )
    resolved = [i % num_layers for i in layers]
    if len(set(resolved)) != len(resolved) or resolved != sorted(resolved):
        raise ValueError(f"layers: must be distinct and in increasing order, got {list(layers)}")
    if not resolved:
        raise ValueError("layers: must name at least one layer")
    return resolved


def param_count(model: Any) -> int:
    """Number of parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


def warn_if_larger(draft: Any, target: Any) -> bool:
    """Warn when a draft is not smaller than its target: it then cannot save time."""
    nd, nt = param_count(draft), param_count(target)
    if nd >= nt:
        warnings.warn(
            f"the draft has {nd:,} parameters, not fewer than the target's {nt:,}: speculative"
            " decoding needs a draft much cheaper than the target to pay",
            UserWarning,
            stacklevel=2,
        )
        return True
    return False


def layer_subset(target: Any, layers: Sequence[int]) -> Any:
    """A draft made of the chosen target layers, with embeddings, norm and head copied."""
    keep = check_layers(layers, target.config.num_hidden_layers)
    cfg = target.config.to_dict()
    cfg["num_hidden_layers"] = len(keep)
    if cfg.get("layer_types"):
        cfg["layer_types"] = [cfg["layer_types"][i] for i in keep]
    draft = same_family(target, _clean(cfg))
    state = target.state_dict()
    new_state = {}
    for name in draft.state_dict():
        src = name
        if name.startswith("model.layers."):
            j, rest = name[len("model.layers.") :].split(".", 1)
            src = f"model.layers.{keep[int(j)]}.{rest}"
        new_state[name] = state[src].detach().clone()
    draft.load_state_dict(new_state)
    return draft.to(next(target.parameters()).dtype)


def from_config(
    target: Any,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    init: str,
    seed: int = 0,
) -> Any:
    """A smaller model of the target's class sharing its vocabulary, rope and context; ``init``
    is ``random`` or ``embedding`` (copy or project the target's embedding, head and norm)."""
    import torch

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size {hidden_size} must divide by num_heads {num_heads}, which must divide"
            f" by num_kv_heads {num_kv_heads}"
        )
    cfg = _clean(target.config.to_dict())
    cfg.update(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
    )
    if "query_pre_attn_scalar" in cfg:  # Gemma scales queries by the head size
        cfg["query_pre_attn_scalar"] = hidden_size // num_heads
    types = cfg.pop("layer_types", None)
    if types:
        cfg["layer_types"] = narrow_layer_types(types, num_layers)
    torch.manual_seed(seed)
    draft = same_family(target, cfg)
    if init == "embedding":
        _copy_embeddings(target, draft)
    elif init != "random":
        raise ValueError(f"init: must be 'random' or 'embedding', got {init!r}")
    return draft.to(next(target.parameters()).dtype)


def same_family(target: Any, cfg: dict[str, Any]) -> Any:
    """A randomly initialised model of ``target``'s own class under config dict ``cfg``."""
    config = type(target.config)(**cfg)
    return type(target)(config)


def narrow_layer_types(types: Sequence[str], num_layers: int) -> list[str]:
    """The target's layer-type pattern cut to ``num_layers``, ending in a full-attention layer
    (when the target has one) so the draft keeps a layer that sees the whole context."""
    out = list(types[:num_layers]) + [types[-1]] * max(0, num_layers - len(types))
    if "full_attention" in types:
        out[-1] = "full_attention"
    return out


def _copy_embeddings(target: Any, draft: Any) -> None:
    """Copy (same width) or project (smaller width) the embedding and the head."""
    import torch

    with torch.no_grad():
        pairs = [(target.get_input_embeddings().weight, draft.get_input_embeddings().weight)]
        if not draft.config.tie_word_embeddings:
            pairs.append((target.get_output_embeddings().weight, draft.get_output_embeddings().weight))
        for src, dst in pairs:
            dst.copy_(project_rows(src.float(), dst.shape[1]).to(dst.dtype))
        if draft.config.hidden_size == target.config.hidden_size:
            draft.model.norm.weight.copy_(target.model.norm.weight)


def project_rows(matrix: "Any", width: int) -> "Any":
    """Rows of ``matrix`` [V, d] in ``width`` <= d coordinates along its top right-singular
    vectors: ``M @ V_width``, the best rank-``width`` summary (identity when width == d)."""
    import torch

    if width == matrix.shape[1]:
        return matrix.clone()
    if width > matrix.shape[1]:
        raise ValueError(
            f"hidden_size: a draft wider ({width}) than its target ({matrix.shape[1]}) cannot copy embeddings"
        )
    _, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (matrix.double() @ vh[:width].T).to(matrix.dtype)


def _clean(cfg: dict[str, Any]) -> dict[str, Any]:
    """Config dict minus the keys that describe a saved instance rather than an architecture."""
    cfg = dict(cfg)
    for key in (
        "_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "quantization_config",
    ):
        cfg.pop(key, None)
    return cfg


def copy_tokenizer(target_dir: Path, out_dir: Path) -> list[str]:
    """Copy the target's tokenizer files and chat setup byte for byte (rebuilding could
    renumber pieces; the draft stops where the target does)."""
    if not tokenizer_files.matching(target_dir, tokenizer_files.TOKENIZER_FILES):
        names = ", ".join(tokenizer_files.TOKENIZER_FILES)
        raise ValueError(f"model: {target_dir} holds no tokenizer files ({names})")
    return tokenizer_files.copy_tokenizer(target_dir, out_dir)


def save_draft(draft: Any, target_dir: Path, out_dir: Path) -> None:
    """Write an HF directory that AutoModelForCausalLM and AutoTokenizer load, then reload its
    tokenizer and assert that every id matches the target's."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir)
    copy_tokenizer(target_dir, out_dir)
    diff = first_vocab_difference(AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(out_dir))
    if diff is not None:
        raise RuntimeError(f"saved draft tokenizer differs from the target's at id {diff[0]}")
