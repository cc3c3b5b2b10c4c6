"""The decoder forward of every served family (`serve.arch`) over a paged KV cache.

Plain tensors and functions instead of nn.Modules: the engine needs a forward over a flat batch
of tokens from many sequences (varlen), never autograd. One forward reads the family's switches
(embedding scale, q/k norms, sandwich norms, activation, per-layer window and RoPE, logit
softcapping); the per-layer pieces live in `serve.layers`. Each layer's K/V lives in a block
group (`serve.kv_layout`): sliding layers read their group's block table, which holds only the
blocks their window can still see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from serve import cpu_kernels, device_io, hugepages
from serve.args import HEAD_QUANTS
from serve.attention import AttentionBackend, SeqChunk, get_backend
from serve.awq import awq_to_gptq_state
from serve.config import ModelConfig
from serve.cpu import upcast_bf16_default
from serve.head import SLICE_ROWS, LogitsBuffer, SlicedHead
from serve.head_quant import Int8Linear
from serve.head_screen import MIN_ROWS as SCREEN_MIN_ROWS
from serve.head_screen import HeadScreen
from serve.kv_cache import KVCache
from serve.kv_layout import KVLayout, bind_to, layout_for
from serve.layers import LayerWeights, Norm, add_norm, apply_rope, gated_activation, load_layer, rms_norm
from serve.quant import DenseLinear
from serve.rope import RotaryEmbedding
from serve.sampler import GumbelDraw
from serve.weights import load_state_dict

__all__ = ["DecoderModel", "ForwardBatch", "LayerWeights", "resolve_dtype", "rms_norm"]
INT4_ACTIVATIONS = ("int8", "float")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept 'bfloat16'/'float32' (or the torch dtype); anything else is a named error."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not supported; use 'bfloat16' (default on CPU) or 'float32'")


@dataclass
class ForwardBatch:
    """Inputs of one forward: flat tokens of all scheduled chunks and what to read out."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    chunks: list[SeqChunk]
    logits_indices: torch.Tensor  # rows whose logits are needed

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host-built index tensors a forward stages to its device: ids, positions, rows."""
        return self.input_ids, self.positions, self.logits_indices


class DecoderModel:
    """Weights plus the forward; holds no per-request state (the KV cache is passed in)."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        int4_activations: str = "int8",
        head_quant: str = "none",
        head_screen: bool = True,
    ) -> None:
        """`int4_activations` (int4 checkpoints on CPU): "int8" quantizes each decode row's
        activations per 32 features for integer dot products (2x faster on AVX2, about 1% error
        per layer, as llama.cpp's Q4 x Q8); "float" keeps them in float32. `head_quant`: "int8"
        rounds the LM head to int8 per row (`serve.head_quant`); "none" keeps the checkpoint's.
        `head_screen`: greedy decode rows find the head's argmax through an int8 copy of a large
        bf16/float32 head (`serve.head_screen`: the same tokens, half the bytes)."""
        if int4_activations not in INT4_ACTIVATIONS:
            raise ValueError(f"int4_activations={int4_activations!r}; use one of {INT4_ACTIVATIONS}")
        if head_quant not in HEAD_QUANTS:
            raise ValueError(f"head_quant={head_quant!r}; use one of {HEAD_QUANTS}")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.int4_activations, self.head_quant = int4_activations, head_quant
        self.backend = backend or get_backend(self.device)
        if config.quant is not None and config.quant.layout == "awq":
            state = awq_to_gptq_state(state)
        if self.device.type != "cpu":
            state = {k: v.to(self.device) for k, v in state.items()}
        self.embed = hugepages.place(state["model.embed_tokens.weight"].to(dtype))  # the tied head streams it
        fam = config.family
        scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=self.device)
        self.embed_scale = scale if fam.embed_scale else None
        self.norm = Norm(state["model.norm.weight"], config.rms_norm_eps, fam.norm_plus_one, dtype)
        self.gated_act = gated_activation(config.activation)
        head = state.get("lm_head.weight")
        if head is None and not config.tie_word_embeddings:
            raise KeyError("checkpoint lacks lm_head.weight and config.json does not tie word embeddings")
        self.lm_head = self.embed if head is None else hugepages.place(head.to(dtype))
        self.head = self._make_head()
        self.screen, self.screen_rows = self._make_screen() if head_screen else (None, 0)
        self._logits = LogitsBuffer()
        self.head_ids: torch.Tensor | None = None  # set by restrict_head: vocabulary id of each logit column
        # logits of a decode batch from a captured graph, None where it does not apply (set by the engine)
        self.decode_graph: Callable[[ForwardBatch, KVCache], torch.Tensor | None] | None = None
        triton_int4 = getattr(self.backend, "name", "") == "triton"  # Triton int4 GEMM too, also when interpreted
        self.layers = [
            load_layer(state, i, config, dtype, self.device, int4_activations, triton_int4)
            for i in range(config.num_layers)
        ]
        self.rope = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, dtype, self.device)
        self.rope_local = (
            RotaryEmbedding(config.rope_local, config.head_dim, config.max_model_len, dtype, self.device)
            if config.rope_local != config.rope
            else self.rope
        )
        self.scale = config.attention_scale
        self.kv_layout = layout_for(config.layer_windows)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        backend: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        int4_activations: str = "int8",
        head_quant: str = "none",
        head_screen: bool = True,
    ) -> "DecoderModel":
        """Read config.json and the safetensors checkpoint of `model_dir` (weights onto `device`)."""
        config = ModelConfig.from_dir(model_dir)
        state = load_state_dict(model_dir)
        return cls(config, state, resolve_dtype(dtype), backend, device, int4_activations, head_quant, head_screen)

    def _make_head(self) -> DenseLinear | Int8Linear | SlicedHead:
        """The vocabulary projection of `lm_head` (prepacked on CPU bf16: the largest matmul);
        by vocabulary slices into float32 on a native-bf16 CPU when the vocabulary is large."""
        if self.head_quant == "int8":
            return Int8Linear(self.lm_head)
        w = self.lm_head
        native_bf16 = w.dtype == torch.bfloat16 and not upcast_bf16_default(w.dtype, w.device)
        if native_bf16 and w.device.type == "cpu" and w.shape[0] > SLICE_ROWS:
            return SlicedHead(w, SLICE_ROWS)
        return DenseLinear(w)

    def _make_screen(self) -> tuple[HeadScreen | None, int]:
        """The int8 screen of a large CPU head and the most rows it serves (those the head's own
        decode kernel computes, whose per-row sums it reproduces); None where it does not apply:
        a quantized or small head, no kernels, another device, or a logit soft-cap (its tanh can
        tie logits the screen would tell apart)."""
        w, head = self.lm_head, self.head
        if not isinstance(head, (SlicedHead, DenseLinear)) or self.config.final_logit_softcapping is not None:
            return None, 0
        if w.device.type != "cpu" or w.shape[0] < SCREEN_MIN_ROWS or not cpu_kernels.available():
            return None, 0
        dense = head.whole if isinstance(head, SlicedHead) else head
        rows = dense.kernel_max_rows if w.dtype == torch.bfloat16 else dense.f32_kernel_max_rows
        if w.dtype not in (torch.bfloat16, torch.float32) or rows < 1:
            return None, 0
        return HeadScreen(w), rows

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
        self.head = self._make_head()
        self.screen, self.screen_rows = None, 0  # a draft's small head: nothing to screen
        self.head_ids = ids.to(self.lm_head.device)

    def bind_kv_layout(self, target: KVLayout) -> None:
        """Use `target`'s block groups (a draft sharing the target's block tables)."""
        self.kv_layout = bind_to(self.config.layer_windows, target)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Memory one pool block costs in this model's cache (its layers per block, K and V)."""
        c = self.config
        return KVCache.bytes_per_block(
            self.kv_layout.layers_per_block, block_size, c.num_kv_heads, c.head_dim, self.dtype
        )

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A KV cache shaped for this model: one slot per layer of a block group."""
        c, per_block = self.config, self.kv_layout.layers_per_block
        return KVCache(per_block, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def _group_metadata(self, chunks: list[SeqChunk], block_size: int) -> dict[tuple[int, int | None], object]:
        """Attention metadata per (block group, window) that some layer reads, built once per forward."""
        metas: dict[tuple[int, int | None], object] = {}
        layout = self.kv_layout
        for i, layer in enumerate(self.layers):
            key = (layout.layer_group[i], layer.window)
            if key in metas:
                continue
            g = key[0]
            group_chunks = [
                replace(c, block_table=c.group_tables[g - 1] if g else c.block_table, window=layer.window)
                for c in chunks
            ]
            with device_io.staging():  # host planning; each backend stages its tensors to the device
                metas[key] = self.backend.build_metadata(group_chunks, block_size)
        return metas

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        reuse_logits: bool = False,
        argmax_only: bool = False,
        draw: GumbelDraw | None = None,
    ) -> torch.Tensor:
        """Write the batch's K/V into `kv` and return float32 logits [len(logits_indices), V] (or,
        for some `argmax_only` batches, each row's argmax as int64 [rows]: see below).

        float32 also because argmax over bf16 takes a slow path on CPU (3x the upcast + argmax).
        `reuse_logits`: the logits may live in this model's buffer, overwritten by its next
        forward (the engine's step loop, which consumes them first; `serve.head`). `argmax_only`:
        the caller reads only each row's argmax (greedy requests without penalties or logprobs), so
        a screened head may leave the other logits approximate, or return the argmax itself
        (`serve.head_screen`; `serve.sampler.argmax_ids` takes either); with `draw`
        every row is perturbed into scores whose argmax is its token (`GumbelDraw`). A decode batch
        goes through `decode_graph` where one is installed (CUDA graphs, `serve.decode_graphs`).
        """
        if self.decode_graph is not None and (logits := self.decode_graph(batch, kv)) is not None:
            return logits if reuse_logits else logits.clone()
        metas = self._group_metadata(batch.chunks, kv.block_size)
        rope_lens = [(ch.query_start, ch.query_len, ch.context_len) for ch in batch.chunks]
        ids, positions, rows = (device_io.to_device(t, self.device) for t in batch.tensors())
        return self.compute(ids, positions, rows, metas, kv, reuse_logits, rope_lens, argmax_only, draw)

    def compute(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        metas: dict[tuple[int, int | None], object],
        kv: KVCache,
        reuse_logits: bool = False,
        rope_lens: list[tuple[int, int, int]] | None = None,
        argmax_only: bool = False,
        draw: GumbelDraw | None = None,
    ) -> torch.Tensor:
        """The forward's device work, from staged ids/positions/logits rows and built metadata.

        Reads nothing back and builds nothing on the host (dynamic NTK's long sequences aside,
        whose `rope_lens` recompute frequencies): the part a CUDA graph captures.
        """
        c = self.config
        write_kv = getattr(self.backend, "write_kv", None)
        tables = {None: self.rope.lookup(positions, rope_lens)}
        if self.rope_local is not self.rope and any(layer.window for layer in self.layers):
            tables[1] = self.rope_local.lookup(positions, rope_lens)
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        n_q, n_kv, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        fused = self._fused_rope_write(kv, write_kv)
        h = self.layers[0].input_norm(x)
        for i, layer in enumerate(self.layers):
            key = (self.kv_layout.layer_group[i], layer.window)
            meta, slot = metas[key], self.kv_layout.layer_slot[i]
            k_cache, v_cache = kv.layers[slot]
            cos, sin = tables[1 if layer.window and 1 in tables else None]
            qk, v = layer.qkv(h).split([n_q + n_kv, n_kv], dim=-1)
            norm = layer.qk_norm
            in_rope = fused and norm is not None and norm.plus_one and qk.dtype == torch.bfloat16
            if norm is not None and not in_rope:  # per-head RMSNorm of q and k in one call, before RoPE
                qk = norm(qk.reshape(-1, c.num_heads + c.num_kv_heads, d))
            if fused:  # (q/k norms,) RoPE and the cache write in one C++ call (serve/csrc/rope_kv.cpp)
                slots = self.backend.slot_mapping(meta)
                extra = (norm.weight, norm.eps) if in_rope else ()
                q, k, v = cpu_kernels.rope_write_kv(qk, v, cos, sin, slots, k_cache, v_cache, c.num_heads, *extra)
            else:
                q, k, v = self._rope_and_write(qk, v, cos, sin, kv, slot, meta, write_kv)
            o = layer.o(self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale).reshape(-1, n_q))
            x, h = add_norm(x, o, layer.attn_out_norm, layer.pre_mlp_norm)
            m = layer.down(self.gated_act(layer.gate_up(h)))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            x, h = add_norm(x, m, layer.mlp_out_norm, following)
        x = self.norm(x.index_select(0, rows))
        batch_screen = self.screen is not None and self.screen.batch is not None
        in_buffer = reuse_logits and (isinstance(self.head, SlicedHead) or batch_screen)
        buffer = self._logits.take(x.shape[0], self.lm_head.shape[0]) if in_buffer else None
        if argmax_only and self.screen is not None and self.screen.pays:
            screened = self.screen.screened(x, draw, self.screen_rows, buffer)
            if screened is not None:
                return screened  # exact at the argmax, int8 elsewhere, or the argmax; no soft-cap here
        if isinstance(self.head, SlicedHead):
            logits = self.head(x, buffer)
        else:
            logits = self.head(x).float()  # on the device: the sampler runs there (serve.device_io)
        cap = c.final_logit_softcapping
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        return logits if draw is None else draw.apply(logits)

    def _fused_rope_write(self, kv: KVCache, write_kv: object) -> bool:
        """Whether this forward rotates and stores K/V with serve's C++ call (CPU, fp32/bf16,
        the torch backend's cache); elsewhere `_rope_and_write` does it with torch ops."""
        return (
            self.device.type == "cpu"
            and write_kv is None
            and self.dtype in (torch.float32, torch.bfloat16)
            and kv.k.dtype == self.dtype
            and cpu_kernels.available()
        )

    def _rope_and_write(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        slot: int,
        meta: object,
        write_kv: object,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE on q and k and the new K/V into the cache with torch ops (any device and dtype)."""
        c = self.config
        qk = apply_rope(qk.reshape(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)  # q and k in one pass
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if write_kv is None:
            kv.write(slot, self.backend.slot_mapping(meta), k, v)
        else:  # a backend with its own cache-write kernel (Triton)
            write_kv(kv.k[slot], kv.v[slot], meta, k, v)
        return q, k, v

    def prefill_logits(self, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
        """float32 logits [len(token_ids), V] of one sequence in a throwaway cache (tests, scoring)."""
        n = len(token_ids)
        blocks = -(-n // block_size)
        groups = self.kv_layout.num_groups
        kv = self.new_kv_cache(blocks * groups, block_size)
        tables = [list(range(g * blocks, (g + 1) * blocks)) for g in range(groups)]
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=torch.arange(n),
            chunks=[SeqChunk(0, n, n, tables[0], tuple(tables[1:]))],
            logits_indices=torch.arange(n),
        )
        return self.forward(batch, kv).float()
