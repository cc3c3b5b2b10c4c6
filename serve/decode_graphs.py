"""CUDA graphs for decode forwards: one graph per batch-size bucket, replayed over padded inputs.

Why: on a GPU the decode step of a 0.5-1B model is mostly kernel launches (about a dozen per
layer, each several microseconds from Python), not arithmetic; a captured graph replays all of
them with one launch. vLLM and gpt-fast do the same.

What is captured: `DecoderModel.compute` for B single-token sequences, B a bucket (`buckets`),
over static buffers: token ids, positions, the logits rows and, per (block group, window), the
Triton backend's metadata (slot mapping, query rows, block tables `max_model_len / block_size`
wide, context lengths). The decode kernel's grid is sized once for `max_model_len` (its programs
past a sequence's context return at once), so one graph serves every context length. A batch of
n < B rows is padded: padded rows read token 0 at position 0 with context length 1 and slot -1
(the cache write skips it), and their logits are dropped.

Where: CUDA, the Triton backend, RoPE other than dynamic NTK (whose tables depend on each
sequence's length), decode-only forwards of at most the largest bucket; every other forward runs
eagerly, as does everything under `--enforce-eager`. The logits a replay returns live in the
graph's memory until the next forward, the contract `DecoderModel.forward(reuse_logits=True)`
already has.

The capture is a parameter: on CUDA `cuda_capture` (warm-up on a side stream, then
`torch.cuda.graph` with one memory pool shared by the buckets, largest first); the tests use
`replay_by_call`, which "replays" by running the same function over the same static buffers, so
that padding and buffer plumbing are checked on the CPU (Triton under its interpreter) token for
token against the eager engine. Capture errors and memory show only on a GPU: `make gpu-check`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from serve import device_io
from serve.attention import SeqChunk
from serve.kv_cache import KVCache
from serve.model import DecoderModel, ForwardBatch

log = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor], object], Callable[[], torch.Tensor]]


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, then multiples of 8 up to `max_batch` (vLLM's spacing)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    return sizes if not sizes or sizes[-1] == max_batch else [*sizes, max_batch]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: object) -> Callable[[], torch.Tensor]:
    """Warm `fn` up on a side stream (Triton compiles there), capture it into a CUDA graph in
    `pool`, and return a replay that gives the graph's output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def replay_by_call(fn: Callable[[], torch.Tensor], pool: object) -> Callable[[], torch.Tensor]:
    """A stand-in capture for tests off CUDA: every replay runs `fn` over the static buffers."""
    fn()
    return fn


@dataclass
class StaticInputs:
    """The buffers every graph reads, sized for the largest bucket (graphs read leading slices)."""

    ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    rows: torch.Tensor  # [max_batch] int64: arange, every row's logits
    metas: dict[tuple[int, int | None], object]  # per (block group, window): Triton metadata


def padded_chunks(chunks: list[SeqChunk], size: int, groups: int) -> list[SeqChunk]:
    """`chunks` (single-token) plus rows up to `size` that read position 0 of block 0."""
    pad = [SeqChunk(i, 1, 1, [0], tuple([0] for _ in range(groups - 1))) for i in range(len(chunks), size)]
    return [*chunks, *pad]


class DecodeGraphs:
    """Captured decode forwards of one model and its KV cache; `__call__` is the model's hook."""

    def __init__(
        self, model: DecoderModel, kv: KVCache, max_batch: int, max_model_len: int, capture: Capture, pool: object
    ) -> None:
        self.model, self.kv = model, kv
        self.width = -(-max_model_len // kv.block_size)  # block-table columns
        self.capacity = self.width * kv.block_size  # longest context the decode grid covers
        self.sizes = buckets(max_batch)
        self.replays = 0
        self.padded_rows = 0  # rows replayed as padding (bucket size - batch size, summed)
        self.static = self._static_inputs(self.sizes[-1])
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        for size in reversed(self.sizes):  # largest first: the others reuse its pool memory
            self.graphs[size] = capture(lambda size=size: self._compute(size), pool)

    def _static_inputs(self, size: int) -> StaticInputs:
        """Buffers for `size` rows, filled with padding (slot -1: nothing is written)."""
        device, groups = self.model.device, self.model.kv_layout.num_groups
        metas = self.model._group_metadata(padded_chunks([], size, groups), self.kv.block_size)
        static = {key: self._static_meta(meta, size) for key, meta in metas.items()}
        return StaticInputs(
            ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            rows=torch.arange(size, device=device),
            metas=static,
        )

    def _static_meta(self, meta: object, size: int) -> object:
        """A copy of Triton decode metadata with its own buffers: tables `width` blocks wide and a
        grid sized for `capacity` positions."""
        plan = meta.decode
        tables = torch.zeros(size, self.width, dtype=plan.block_tables.dtype, device=plan.block_tables.device)
        return replace(
            meta,
            slot_mapping=torch.full_like(meta.slot_mapping, -1),
            decode=replace(
                plan,
                q_rows=plan.q_rows.clone(),
                block_tables=tables,
                context_lens=torch.ones_like(plan.context_lens),
                max_context_len=self.capacity,
            ),
        )

    def _sliced(self, meta: object, size: int) -> object:
        """The leading `size` rows of a static metadata."""
        plan = meta.decode
        return replace(
            meta,
            slot_mapping=meta.slot_mapping[:size],
            num_tokens=size,
            decode=replace(
                plan,
                q_rows=plan.q_rows[:size],
                block_tables=plan.block_tables[:size],
                context_lens=plan.context_lens[:size],
            ),
        )

    def _compute(self, size: int) -> torch.Tensor:
        """The captured function: the model over the first `size` static rows."""
        s = self.static
        metas = {key: self._sliced(meta, size) for key, meta in s.metas.items()}
        return self.model.compute(s.ids[:size], s.positions[:size], s.rows[:size], metas, self.kv, reuse_logits=True)

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket a forward replays in, None when it must run eagerly."""
        n = len(batch.chunks)
        if n == 0 or n > self.sizes[-1] or any(not self._fits(c) for c in batch.chunks):
            return None
        if batch.logits_indices.numel() != n:  # a row without logits (the draft catching up)
            return None
        return next(size for size in self.sizes if size >= n)

    def _fits(self, chunk: SeqChunk) -> bool:
        """A single-token chunk whose context and block tables fit the static buffers."""
        tables = (chunk.block_table, *chunk.group_tables)
        return chunk.query_len == 1 and chunk.context_len <= self.capacity and all(len(t) <= self.width for t in tables)

    def __call__(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor | None:
        """Logits [n, V] of a decode batch from its bucket's graph; None to run eagerly."""
        size = self.bucket(batch) if kv is self.kv else None
        if size is None:
            return None
        self._fill(batch, size)
        self.replays += 1
        self.padded_rows += size - len(batch.chunks)
        return self.graphs[size]()[: len(batch.chunks)]

    def _fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy the batch's inputs and metadata into the static buffers, padded to `size`."""
        n, s, device = len(batch.chunks), self.static, self.model.device
        groups = self.model.kv_layout.num_groups
        metas = self.model._group_metadata(padded_chunks(batch.chunks, size, groups), self.kv.block_size)
        with device_io.staging():
            pad = torch.zeros(size - n, dtype=torch.long)
            s.ids[:size].copy_(device_io.to_device(torch.cat([batch.input_ids, pad]), device))
            s.positions[:size].copy_(device_io.to_device(torch.cat([batch.positions, pad]), device))
        for key, meta in metas.items():
            static, plan = s.metas[key], meta.decode
            static.slot_mapping[:size].copy_(meta.slot_mapping)
            static.slot_mapping[n:size].fill_(-1)
            static.decode.block_tables[:size, : plan.block_tables.shape[1]].copy_(plan.block_tables)
            static.decode.context_lens[:size].copy_(plan.context_lens)


def install(
    model: DecoderModel, kv: KVCache, max_batch: int, max_model_len: int, capture: Capture, pool: object = None
) -> DecodeGraphs | None:
    """Capture `model`'s decode graphs over `kv` and hook them into its forward; None (and a log
    line saying why) where graphs do not apply."""
    why = None
    if getattr(model.backend, "name", "") != "triton":
        why = "the attention backend is not Triton"
    elif model.rope.rope.rope_type == "dynamic" or model.rope_local.rope.rope_type == "dynamic":
        why = "dynamic NTK RoPE recomputes its tables per sequence length"
    if why is not None:
        log.info("decode steps run eagerly: %s", why)
        return None
    start = time.perf_counter()
    graphs = DecodeGraphs(model, kv, max_batch, max_model_len, capture, pool)
    model.decode_graph = graphs
    log.info(
        "captured decode graphs for batches of %s in %.1f s",
        ", ".join(map(str, graphs.sizes)),
        time.perf_counter() - start,
    )
    return graphs
