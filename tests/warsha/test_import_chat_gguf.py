"""``import`` of an instruct GGUF like a registry's (Llama, byte-level BPE, ChatML template).

The GGUF is written here with the ``gguf`` package (the ``real`` extra) the way llama.cpp's
converter writes one: float32 tensors under llama.cpp's names, Q and K rows permuted into its
rotary layout, a ``gpt2`` vocabulary with ChatML specials, and the template in
``tokenizer.chat_template``. The imported directory must reproduce the source model's logits and
carry the template and the end-of-turn stop id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from warsha import tokenizer_files
from warsha.model_import.stage import ImportParams, ImportSource, import_model

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def _vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(set(bytes_to_unicode().values())) + [m.replace(" ", "") for m in MERGES]


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary row order for Q and K (``convert_hf_to_gguf.LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    cfg, sd = model.config, model.state_dict()
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            out[f"blk.{i}.{gg}.weight"] = sd[f"model.layers.{i}.{hf}.weight"]
        q, k = sd[f"model.layers.{i}.self_attn.q_proj.weight"], sd[f"model.layers.{i}.self_attn.k_proj.weight"]
        out[f"blk.{i}.attn_q.weight"] = _permute(q, cfg.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = _permute(k, cfg.num_key_value_heads)
    return out


def write_chat_gguf(path: Path) -> Any:
    """A tiny random Llama with a ChatML byte-level vocabulary as a GGUF file; the HF model."""
    gguf = pytest.importorskip("gguf", reason="the 'real' extra installs gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _vocab()
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(vocab))
    w.add_file_type(0)  # all float32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, tensor in _tensors(model).items():
        w.add_tensor(name, tensor.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_instruct_gguf_imports_with_its_template_and_stop_id(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = write_chat_gguf(tmp_path / "chat.gguf")
    metrics = import_model(ImportParams(ImportSource(path=str(tmp_path / "chat.gguf"))), tmp_path / "out")
    assert metrics["source"]["dequantized_from"] == "ALL_F32" and metrics["model_type"] == "llama"
    out = tmp_path / "out"
    assert tokenizer_files.chat_template(out) == CHATML
    assert tokenizer_files.stop_ids(out) == [2]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    ids = tok.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids) == [
        *("<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "<|im_end|>", "Ċ"),  # "h e" merges, "t he" is none
        *("<|im_start|>", "a", "s", "s", "i", "s", "t", "a", "n", "t", "Ċ"),
    ]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        torch.testing.assert_close(model(input_ids=x).logits, src(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
