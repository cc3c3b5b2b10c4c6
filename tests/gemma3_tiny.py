"""A tiny random Gemma 3 with a Gemma-format tokenizer, built in-process (nothing downloaded).

The tokenizer is transformers' own ``GemmaTokenizer`` (byte-fallback BPE, ``▁`` normaliser, the
same tokenizer.json layout the real Gemma 3 ships) over a small BPE trained here on mostly
English text, so its Arabic is as expensive as a real English-centric base's. The model keeps
Gemma 3's traits the stages must respect: tied embeddings, sliding/full layer types with
per-layer-type RoPE, q/k norms and the four norms per layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def gemma3_config(vocab_size: int, **extra: Any) -> Any:
    """A 6-layer Gemma 3 text config (5 sliding layers then one full-attention layer)."""
    from transformers import Gemma3TextConfig

    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "sliding_window": 32,
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    }
    kwargs.update(extra)
    return Gemma3TextConfig(**kwargs)


def gemma_tokenizer(texts: list[str], n_merges: int = 3000) -> Any:
    """A ``GemmaTokenizer`` whose merges are trained on ``texts`` (byte fallback for the rest)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=n_merges, show_progress=False, min_frequency=2, limit_alphabet=400)
    trainer_tok.train_from_iterator(texts, trainer)
    import json

    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    return GemmaTokenizer(vocab=vocab, merges=merges)


def save_tiny_gemma3(out: Path, texts: list[str], seed: int = 0, n_merges: int = 3000) -> tuple[Any, Any]:
    """Write model and tokenizer to ``out``; return both."""
    import torch
    from transformers import Gemma3ForCausalLM

    tok = gemma_tokenizer(texts, n_merges)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config(len(tok)))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok
