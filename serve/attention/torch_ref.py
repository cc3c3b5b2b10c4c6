"""Torch paged attention for CPU: one block gather + two batched matmuls per query-length group.

Why this shape: decode steps (query length 1) of all running sequences become one batched
computation over their cached keys; verification chunks of speculative decoding (query length
k+1) batch the same way; a prefill chunk with no cached context skips the gather and runs causal
SDPA on the fresh keys. Keys are gathered by whole blocks with `index_select` from the
heads-first cache ([kv_heads, slots, head_dim]), which yields [kv_heads, B, L, head_dim] without
a transpose copy; GQA query heads are grouped onto their KV head so K/V are never repeated.
All index and mask arithmetic happens once per forward in `build_metadata`, never per layer and
never per token in Python. Scores and softmax run in float32. On a CPU without native bf16
(`serve.cpu`) a bf16 cache is gathered and upcast, and both matmuls run in float32 (bf16 batched
matmuls are emulated there, 3-15x slower); the output is rounded to bf16 once.

Short chunks on the CPU (query length at most `KERNEL_MAX_QUERY`: decode steps and speculative
verification, also inside a step that prefills others) go to serve's kernel instead
(`serve.cpu_kernels`), which reads the paged cache in place with an online softmax; for chunks
of that shape this module's path is mostly op launches. Long prefill chunks stay on SDPA and
the batched matmuls, whose GEMMs win there, except where the CPU multiplies bf16 natively
(`cpu_kernels.has_bf16_dot`): a bf16 chunk with head size a multiple of 64 then goes to the
kernel too, cut into `KERNEL_PREFILL_PIECE`-token pieces. A piece is a chunk of its own (its
context ends at its last token), so the kernel's tasks spread over both threads and skip the
keys after a piece's last token, where torch's causal SDPA ran at about 70 GFLOP/s (Zen 4,
2 threads, Gemma 3's 4 heads of 256 on one KV head: a 512-token chunk 6.3 -> 3.8 ms).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from serve import cpu_kernels
from serve.attention.interface import SeqChunk
from serve.cpu import upcast_bf16_default
from serve.device_io import to_device
from serve.kv_cache import block_table_tensor, slots_for


@dataclass
class AttentionGroup:
    """Sequences sharing one query length, attended to together."""

    query_len: int
    batch: int
    row_range: tuple[int, int] | None  # contiguous token rows, else `rows`
    rows: torch.Tensor | None  # [B * Q] token rows
    block_ids: torch.Tensor | None  # [B * max_blocks] blocks to gather; None for a fresh causal chunk
    num_blocks: int
    block_size: int
    mask: torch.Tensor | None  # [B, Q, L] additive float32 (0 / -inf); None if nothing to mask


@dataclass
class TorchAttentionMetadata:
    """Per-forward indices shared by all layers."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup] | None  # None: built on first use (`torch_groups`)
    num_tokens: int
    kernel_plan: cpu_kernels.AttentionPlan | None = None  # the short chunks, when the CPU kernel takes them
    chunks: list[SeqChunk] | None = None  # all chunks and their tables, for torch's plans if the kernel
    tables: torch.Tensor | None = None  # cannot take this forward's tensors after all
    kernel_plan_all: cpu_kernels.AttentionPlan | None = None  # every chunk, long ones in pieces (bf16 dot CPUs)
    torch_chunks: list[int] | None = None  # the chunks `groups` covers


# query length up to which the CPU kernel attends a chunk (decode, speculative verification)
KERNEL_MAX_QUERY = 16
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# tokens per piece of a long chunk on the kernel: 8-32 measured alike, 64 slower, a whole
# 512-token chunk 2.7x slower (one task per KV head, and every key scored for every row)
KERNEL_PREFILL_PIECE = 16


def _check_layout(chunks: list[SeqChunk]) -> None:
    """Chunks must tile the flat batch in order; the engine builds them that way."""
    expected = 0
    for c in chunks:
        if c.query_start != expected or c.query_len < 1 or c.context_len < c.query_len:
            raise ValueError(f"attention metadata: chunk {c} does not continue the batch at row {expected}")
        if not c.block_table:
            raise ValueError(f"attention metadata: chunk {c} has an empty block table")
        expected += c.query_len


# a group is cut where a context falls below this fraction of its longest: higher cuts more
# groups but gathers and multiplies less padding; 0.7 was the faster of the values tried
SPLIT_RATIO = 0.7


def split_by_context(
    idx: list[int], lengths: list[int], min_group: int = 8, ratio: float | None = None
) -> list[list[int]]:
    """Split a same-query-length group so that padding to the longest context stays bounded.

    Sequences are sorted by context length and cut where a context falls below `ratio` (SPLIT_RATIO) of its
    group's longest; groups smaller than `min_group` are merged into their neighbour because
    every group costs a fixed number of op launches per layer.
    """
    if len(idx) <= min_group:
        return [idx]
    ratio = SPLIT_RATIO if ratio is None else ratio
    order = sorted(range(len(idx)), key=lambda j: -lengths[j])
    parts: list[list[int]] = [[]]
    longest = lengths[order[0]]
    for j in order:
        if (
            lengths[j] < ratio * longest
            and len(parts[-1]) >= min_group
            and len(order) - sum(map(len, parts)) >= min_group
        ):
            parts.append([])
            longest = lengths[j]
        parts[-1].append(idx[j])
    return [sorted(p) for p in parts]


def _mask(ctx: torch.Tensor, q_len: int, length: int, key_start: int, window: int | None) -> torch.Tensor:
    """Additive mask [B, Q, L]: keys at positions key_start + j, causal and inside the window."""
    q_pos = (ctx - q_len)[:, None] + torch.arange(q_len)[None, :]
    k_pos = key_start + torch.arange(length)[None, None, :]
    allowed = k_pos <= q_pos[:, :, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, :, None] - window
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


class TorchPagedAttention:
    """The reference backend: the CPU's, and CUDA's where triton is missing."""

    name = "torch"

    def __init__(
        self, upcast_bf16: bool | None = None, cpu_kernel: bool | None = None, device: torch.device | str = "cpu"
    ) -> None:
        """`upcast_bf16`: compute bf16 attention in float32; None decides by the hardware.

        `cpu_kernel`: attend short chunks with serve's AVX2 kernel; None uses it where it builds
        (never off the CPU). `device`: where the metadata's tensors go (`serve.device_io`).
        """
        self.upcast_bf16 = upcast_bf16
        self.cpu_kernel = cpu_kernel
        self.device = torch.device(device)

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TorchAttentionMetadata:
        """Slot mapping for the new tokens and one gather plan per query-length group."""
        _check_layout(chunks)
        tables = block_table_tensor([c.block_table for c in chunks])
        # plain lists: for a decode step these are a handful of ints, and small torch ops
        # (repeat_interleave above all) cost more than the arithmetic itself
        seq_of_token = [i for i, c in enumerate(chunks) for _ in range(c.query_len)]
        positions = [p for c in chunks for p in range(c.context_len - c.query_len, c.context_len)]
        num_tokens = len(positions)
        slot_mapping = slots_for(tables, torch.tensor(seq_of_token), torch.tensor(positions), block_size)
        short = self._kernel_chunks(chunks)
        plan = self._plan(chunks, short, tables, block_size) if short else None
        taken = set(short)
        rest = [i for i in range(len(chunks)) if i not in taken]
        plan_all, groups = None, None
        if rest and self._kernel_takes_long():  # torch's plans (masks of [B, Q, L]) only if a layer needs them
            plan_all = self._plan(chunks, list(range(len(chunks))), tables, block_size, KERNEL_PREFILL_PIECE)
        else:
            groups = self._groups(chunks, rest, tables, block_size)
        if self.device.type != "cpu":
            slot_mapping, groups = to_device(slot_mapping, self.device), [self._staged(g) for g in groups]
        return TorchAttentionMetadata(slot_mapping, groups, num_tokens, plan, chunks, tables, plan_all, rest)

    def torch_groups(self, metadata: TorchAttentionMetadata) -> list[AttentionGroup]:
        """The torch path's plans for the chunks the kernel's short plan leaves, built once per forward."""
        if metadata.groups is None:
            assert metadata.chunks is not None and metadata.tables is not None and metadata.torch_chunks is not None
            block_size = metadata.kernel_plan_all.block_size if metadata.kernel_plan_all is not None else 0
            metadata.groups = self._groups(metadata.chunks, metadata.torch_chunks, metadata.tables, block_size)
        return metadata.groups

    def _staged(self, g: AttentionGroup) -> AttentionGroup:
        """`g` with its index and mask tensors on this backend's device."""
        moved = {name: getattr(g, name) for name in ("rows", "block_ids", "mask")}
        return replace(g, **{k: None if v is None else to_device(v, self.device) for k, v in moved.items()})

    def _kernel_chunks(self, chunks: list[SeqChunk]) -> list[int]:
        """Indices of the chunks the CPU kernel attends: the short ones, where the kernel built."""
        short = [i for i, c in enumerate(chunks) if c.query_len <= KERNEL_MAX_QUERY]
        if not short or self.cpu_kernel is False or self.device.type != "cpu" or not cpu_kernels.available():
            return []
        return short

    def _kernel_takes_long(self) -> bool:
        """Whether long bf16 chunks may go to the kernel: a CPU with native bf16 dot products."""
        return self.cpu_kernel is not False and self.device.type == "cpu" and cpu_kernels.has_bf16_dot()

    @staticmethod
    def _plan(
        chunks: list[SeqChunk], idx: list[int], tables: torch.Tensor, block_size: int, piece: int | None = None
    ) -> cpu_kernels.AttentionPlan:
        """The kernel's inputs for the chunks `idx` (their query rows stay where they are in the batch).

        With `piece`, a chunk longer than that is cut into pieces of `piece` tokens, each a chunk
        whose context ends at its own last token: the same rows see the same keys.
        """
        rows: list[int] = []
        parts: list[tuple[int, int, int]] = []  # (query_start, query_len, context_len)
        for i in idx:
            c = chunks[i]
            step = c.query_len if piece is None else piece
            first = c.context_len - c.query_len
            for a in range(0, c.query_len, step):
                n = min(step, c.query_len - a)
                rows.append(i)
                parts.append((c.query_start + a, n, first + a + n))
        same = rows == list(range(len(chunks)))
        return cpu_kernels.AttentionPlan(
            block_tables=tables if same else tables[torch.tensor(rows)],
            context_lens=torch.tensor([p[2] for p in parts]),
            query_starts=torch.tensor([p[0] for p in parts]),
            query_lens=torch.tensor([p[1] for p in parts]),
            block_size=block_size,
            window=chunks[idx[0]].window,
        )

    def _groups(
        self, chunks: list[SeqChunk], idx: list[int], tables: torch.Tensor, block_size: int
    ) -> list[AttentionGroup]:
        """The torch path's gather plans for chunks `idx`: per query length, split where contexts differ a lot."""
        by_len: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            by_len[chunks[i].query_len].append(i)
        return [
            self._group(chunks, part, tables, block_size)
            for same in by_len.values()
            for part in split_by_context(same, [chunks[i].context_len for i in same])
        ]

    @staticmethod
    def _group(chunks: list[SeqChunk], idx: list[int], tables: torch.Tensor, block_size: int) -> AttentionGroup:
        """Gather plan and additive mask for the sequences `idx`, which share one query length."""
        q_len = chunks[idx[0]].query_len
        first = chunks[idx[0]].query_start
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        row_range = (first, first + q_len * len(idx)) if contiguous else None
        rows = (
            None
            if contiguous
            else (torch.tensor([chunks[i].query_start for i in idx])[:, None] + torch.arange(q_len)).reshape(-1)
        )
        ctx = torch.tensor([chunks[i].context_len for i in idx])
        window = chunks[idx[0]].window
        if len(idx) == 1 and int(ctx[0]) == q_len:
            mask = None if window is None or q_len <= window else _mask(ctx, q_len, q_len, 0, window)
            return AttentionGroup(q_len, 1, row_range, rows, None, 0, block_size, mask)
        n_blocks = -(-int(ctx.max()) // block_size)
        # a sliding window reads only from the first block any of the group's queries can see
        first = 0 if window is None else max(0, int((ctx - q_len).min()) - window + 1) // block_size
        block_ids = tables[torch.tensor(idx)][:, first:n_blocks].reshape(-1)
        length = (n_blocks - first) * block_size
        mask = None
        if q_len > 1 or bool((ctx != n_blocks * block_size).any()) or window is not None:
            mask = _mask(ctx, q_len, length, first * block_size, window)
        return AttentionGroup(q_len, len(idx), row_range, rows, block_ids, n_blocks - first, block_size, mask)

    def slot_mapping(self, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """Cache slot of every new token."""
        return metadata.slot_mapping

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, D] against one layer's paged cache [Hkv, slots, D]; returns [T, H, D]."""
        whole = metadata.kernel_plan_all
        if whole is not None and q.dtype == torch.bfloat16 == k_cache.dtype and q.shape[-1] % 64 == 0:
            return cpu_kernels.paged_attention(q, k_cache, v_cache, whole, scale)  # every row, long chunks in pieces
        plan, groups, out = metadata.kernel_plan, self.torch_groups(metadata), None
        if plan is not None and q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in KERNEL_DTYPES:
            out = cpu_kernels.paged_attention(q, k_cache, v_cache, plan, scale)  # the short chunks' rows
        elif plan is not None:  # tensors the kernel cannot take (device, dtype): every chunk on torch
            groups = self._groups(metadata.chunks, list(range(len(metadata.chunks))), metadata.tables, plan.block_size)
        up = self.upcast_bf16
        up = q.dtype == torch.bfloat16 and (upcast_bf16_default(q.dtype, q.device) if up is None else up)
        if out is None and len(groups) == 1 and groups[0].row_range == (0, q.shape[0]):
            return (
                self._group_forward(q, k_new, v_new, k_cache, v_cache, groups[0], scale, up)
                .reshape(q.shape)
                .to(q.dtype)
            )
        out = torch.empty_like(q) if out is None else out
        for g in groups:
            o = (
                self._group_forward(q, k_new, v_new, k_cache, v_cache, g, scale, up)
                .reshape(-1, *q.shape[1:])
                .to(q.dtype)
            )
            if g.row_range is not None:
                out[g.row_range[0] : g.row_range[1]] = o
            else:
                out.index_copy_(0, g.rows, o)
        return out

    @staticmethod
    def _take(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """Rows of group `g` from a flat [T, heads, D] tensor, as [B, Q, heads, D]."""
        part = x[g.row_range[0] : g.row_range[1]] if g.row_range is not None else x.index_select(0, g.rows)
        return part.reshape(g.batch, g.query_len, *x.shape[1:])

    def _group_forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: AttentionGroup,
        scale: float,
        upcast: bool = False,
    ) -> torch.Tensor:
        """Attention for one group; output [B, Q, H, D] (float32 when `upcast`)."""
        qg = self._take(q, g).float() if upcast else self._take(q, g)
        if g.block_ids is None:
            kg, vg = self._take(k_new, g), self._take(v_new, g)
            if upcast:
                kg, vg = kg.float(), vg.float()
            o = F.scaled_dot_product_attention(
                qg.transpose(1, 2),
                kg.transpose(1, 2),
                vg.transpose(1, 2),
                attn_mask=None if g.mask is None else g.mask[:, None].to(qg.dtype),
                is_causal=g.query_len > 1 and g.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            return o.transpose(1, 2)
        kv_heads, _, dim = k_cache.shape
        batch, q_len, heads = g.batch, g.query_len, q.shape[1]
        group = heads // kv_heads
        keys = self._gather(k_cache, g)
        values = self._gather(v_cache, g)
        if upcast:
            keys, values = keys.float(), values.float()
        length = keys.shape[2]
        # [B, Q, Hkv, G, D] -> [Hkv, B, G*Q, D]: query heads grouped onto their KV head
        qh = (
            qg.reshape(batch, q_len, kv_heads, group, dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(kv_heads, batch, group * q_len, dim)
        )
        scores = torch.matmul(qh, keys.transpose(-1, -2)).float().mul_(scale)
        scores = scores.view(kv_heads, batch, group, q_len, length)
        if g.mask is not None:
            scores = scores + g.mask[None, :, None]
        probs = scores.softmax(-1).to(values.dtype).view(kv_heads, batch, group * q_len, length)
        o = torch.matmul(probs, values).view(kv_heads, batch, group, q_len, dim)
        return o.permute(1, 3, 0, 2, 4).reshape(batch, q_len, heads, dim)

    @staticmethod
    def _gather(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """Whole blocks of the group's sequences: [Hkv, slots, D] -> [Hkv, B, L, D], one copy."""
        kv_heads, _, dim = cache.shape
        picked = cache.view(kv_heads, -1, g.block_size * dim).index_select(1, g.block_ids)
        return picked.view(kv_heads, g.batch, g.num_blocks * g.block_size, dim)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: list[SeqChunk],
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Slow, obviously-correct paged attention: per sequence, slot by slot, explicit softmax.

    Caches are one layer's [kv_heads, slots, head_dim]. Kept as the oracle that the fast path
    and future kernels are tested against.
    """
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.empty_like(q)
    for c in chunks:
        table = [max(b, 0) for b in c.block_table]  # handed-back blocks are masked below
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c.context_len)]
        k = k_cache[:, slots].transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[:, slots].transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=1)
        qc = q[c.query_start : c.query_start + c.query_len].float()
        scores = torch.einsum("qhd,khd->hqk", qc, k) * scale
        q_pos = torch.arange(c.context_len - c.query_len, c.context_len)
        allowed = torch.arange(c.context_len)[None, :] <= q_pos[:, None]
        if c.window is not None:
            allowed &= torch.arange(c.context_len)[None, :] > q_pos[:, None] - c.window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[c.query_start : c.query_start + c.query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(
            q.dtype
        )
    return out
