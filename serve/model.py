"""The Llama-family forward (Llama, Mistral, Qwen2) over a paged KV cache.

Plain tensors and functions instead of nn.Modules: the engine needs a forward over a flat batch
of tokens from many sequences (varlen), never autograd. Projections are fused at load (q|k|v
and gate|up) so each layer runs four matmuls. Norms run in float32 and round back as
transformers does, so bf16 logits stay close to the HF reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from serve import cpu_kernels
from serve.attention import AttentionBackend, SeqChunk, get_backend
from serve.config import ModelConfig
from serve.kv_cache import KVCache
from serve.quant import DenseLinear, Int4Linear, can_fuse, gptq_to_int4_parts
from serve.rope import RotaryEmbedding
from serve.weights import load_state_dict

Linear = Callable[[torch.Tensor], torch.Tensor]
INT4_ACTIVATIONS = ("int8", "float")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept 'bfloat16'/'float32' (or the torch dtype); anything else is a named error."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not supported; use 'bfloat16' (default on CPU) or 'float32'")


class SplitLinear:
    """Several linears on the same input whose outputs are concatenated (unfusable int4 parts)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the parts' outputs along the feature dim."""
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass
class LayerWeights:
    """One decoder layer: fused projections and the two norms."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


@dataclass
class ForwardBatch:
    """Inputs of one forward: flat tokens of all scheduled chunks and what to read out."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    chunks: list[SeqChunk]
    logits_indices: torch.Tensor  # rows whose logits are needed


def _fused_linear(
    state: dict[str, torch.Tensor],
    names: list[str],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    int4_activations: str = "int8",
) -> Linear:
    """One linear for projections sharing an input: concatenated dense weights or int4 parts
    (serve's AVX2 kernel and torch's int4 kernel on CPU, the Triton int4 GEMM elsewhere)."""
    biases = [state.get(f"{n}.bias") for n in names]
    bias = torch.cat([b.to(dtype) for b in biases]) if all(b is not None for b in biases) else None
    if f"{names[0]}.qweight" not in state:
        missing = [n for n in names if f"{n}.weight" not in state]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[0]}.weight (nor a GPTQ qweight); is it a Llama-family model?")
        return DenseLinear(torch.cat([state[f"{n}.weight"].to(dtype) for n in names]), bias)
    if config.quant is None:
        raise ValueError(
            f"{names[0]}.qweight found but config.json has no quantization_config; the checkpoint is inconsistent"
        )
    q = config.quant
    if torch.device(device).type != "cpu":
        from serve.triton_int4 import Int4TritonLinear

        return SplitLinear(
            [
                Int4TritonLinear(
                    state[f"{n}.qweight"],
                    state[f"{n}.qzeros"],
                    state[f"{n}.scales"],
                    state.get(f"{n}.g_idx"),
                    q.group_size,
                    b.to(dtype) if b is not None else None,
                    q.checkpoint_format,
                )
                for n, b in zip(names, biases)
            ]
        )
    parts = [
        gptq_to_int4_parts(
            n,
            state[f"{n}.qweight"],
            state[f"{n}.qzeros"],
            state[f"{n}.scales"],
            state.get(f"{n}.g_idx"),
            q.group_size,
            q.checkpoint_format,
        )
        for n in names
    ]
    a8 = int4_activations == "int8"
    if can_fuse(parts):
        return Int4Linear(parts, bias, int8_activations=a8)
    return SplitLinear(
        [Int4Linear([p], b.to(dtype) if b is not None else None, int8_activations=a8) for p, b in zip(parts, biases)]
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded back to x's dtype before the weight (transformers' order).

    torch's fused `rms_norm` accumulates bf16 input in float32 and rounds once, which is
    bit-identical to transformers' upcast / normalise / downcast (tested), in one op instead of
    seven and without two dtype round trips per norm. On CPU, bf16 rows take serve's C++ version
    of the same formula (`cpu_kernels`): torch's fused norm still costs ~50 us per decode row.
    """
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and cpu_kernels.available()
    ):
        return cpu_kernels.rms_norm_bf16(x, weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaModel:
    """Weights plus the forward; holds no per-request state (the KV cache is passed in)."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        int4_activations: str = "int8",
    ) -> None:
        """`int4_activations` (int4 checkpoints on CPU): "int8" quantizes each decode row's
        activations per 32 features for integer dot products (2x faster on AVX2, about 1% error
        per layer, as llama.cpp's Q4 x Q8); "float" keeps them in float32."""
        if int4_activations not in INT4_ACTIVATIONS:
            raise ValueError(f"int4_activations={int4_activations!r}; use one of {INT4_ACTIVATIONS}")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.int4_activations = int4_activations
        self.backend = backend or get_backend(self.device)
        if self.device.type != "cpu":
            state = {k: v.to(self.device) for k, v in state.items()}
        self.embed = state["model.embed_tokens.weight"].to(dtype)
        self.norm = state["model.norm.weight"].to(dtype)
        head = state.get("lm_head.weight")
        if head is None and not config.tie_word_embeddings:
            raise KeyError("checkpoint lacks lm_head.weight and config.json does not tie word embeddings")
        self.lm_head = self.embed if head is None else head.to(dtype)
        self.head = DenseLinear(self.lm_head)  # prepacked on CPU bf16: the head is the largest matmul
        self.head_ids: torch.Tensor | None = None  # set by restrict_head: vocabulary id of each logit column
        self.layers = [self._layer(state, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, dtype)
        self.scale = config.head_dim**-0.5

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        backend: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        int4_activations: str = "int8",
    ) -> "LlamaModel":
        """Read config.json and the safetensors checkpoint of `model_dir` (weights onto `device`)."""
        config = ModelConfig.from_dir(model_dir)
        return cls(config, load_state_dict(model_dir), resolve_dtype(dtype), backend, device, int4_activations)

    def _layer(self, state: dict[str, torch.Tensor], i: int) -> LayerWeights:
        """Fuse layer `i`'s projections."""
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
        return LayerWeights(
            qkv=_fused_linear(state, attn, self.config, self.dtype, self.device, self.int4_activations),
            o=_fused_linear(
                state, [f"{p}self_attn.o_proj"], self.config, self.dtype, self.device, self.int4_activations
            ),
            gate_up=_fused_linear(
                state,
                [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"],
                self.config,
                self.dtype,
                self.device,
                self.int4_activations,
            ),
            down=_fused_linear(
                state, [f"{p}mlp.down_proj"], self.config, self.dtype, self.device, self.int4_activations
            ),
            input_norm=state[f"{p}input_layernorm.weight"].to(self.dtype),
            post_attention_norm=state[f"{p}post_attention_layernorm.weight"].to(self.dtype),
        )

    def restrict_head(self, token_ids: list[int]) -> None:
        """Compute logits only for `token_ids` (a draft's frequent tokens).

        Why: in a small draft the vocabulary projection is most of the cost (a 48k-row head on a
        128-wide model is 90% of its FLOPs), and the target rarely picks tokens outside the
        few thousand most frequent. Logit column j then stands for vocabulary id
        `head_ids[j]`; speculation stays exact because the rejection sampler only needs q to be
        a distribution, which it still is (zero outside the subset).
        """
        vocab = self.lm_head.shape[0]
        ids = torch.tensor(token_ids, dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
            raise ValueError(f"draft vocabulary: token ids must be distinct and in [0, {vocab}), got {ids.numel()} ids")
        self.lm_head = self.lm_head.index_select(0, ids.to(self.lm_head.device))
        self.head = DenseLinear(self.lm_head)
        self.head_ids = ids

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A KV cache shaped for this model."""
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Write the batch's K/V into `kv` and return float32 logits [len(logits_indices), V].

        float32 also because argmax over bf16 takes a slow path on CPU (3x the upcast + argmax).
        """
        c = self.config
        meta = self.backend.build_metadata(batch.chunks, kv.block_size)
        slots = self.backend.slot_mapping(meta)
        write_kv = getattr(self.backend, "write_kv", None)
        rope_lens = [(ch.query_start, ch.query_len, ch.context_len) for ch in batch.chunks]
        cos, sin = self.rope.lookup(batch.positions, rope_lens)  # tables stay on CPU (small)
        if self.device.type != "cpu":
            cos, sin = cos.to(self.device), sin.to(self.device)
        x = F.embedding(batch.input_ids.to(self.device), self.embed)
        n_q, n_kv, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qk, v = layer.qkv(h).split([n_q + n_kv, n_kv], dim=-1)
            qk = apply_rope(qk.reshape(-1, c.num_heads + c.num_kv_heads, d), cos, sin)  # q and k in one pass
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = v.reshape(-1, c.num_kv_heads, d)
            if write_kv is None:
                kv.write(i, slots, k, v)
            else:  # a backend with its own cache-write kernel (Triton)
                write_kv(kv.k[i], kv.v[i], meta, k, v)
            o = self.backend.forward(q, k, v, kv.k[i], kv.v[i], meta, self.scale)
            x = x + layer.o(o.reshape(-1, n_q))
            h = rms_norm(x, layer.post_attention_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = rms_norm(x.index_select(0, batch.logits_indices.to(self.device)), self.norm, c.rms_norm_eps)
        return self.head(x).float().cpu()  # sampling runs on the host

    def prefill_logits(self, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
        """float32 logits [len(token_ids), V] of one sequence in a throwaway cache (tests, scoring)."""
        n = len(token_ids)
        blocks = -(-n // block_size)
        kv = self.new_kv_cache(blocks, block_size)
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=torch.arange(n),
            chunks=[SeqChunk(0, n, n, list(range(blocks)))],
            logits_indices=torch.arange(n),
        )
        return self.forward(batch, kv).float()
