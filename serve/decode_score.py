"""Teacher-forced scoring through the engine's batch-1 decode path, one token per forward.

Each position runs as a one-row decode step (never the prefill path), so what is scored is what
the decode kernels compute, e.g. the int8-activation int4 kernel (`python -m benchmarks.int4_decode_ppl`
compares its perplexity with float activations and with the unquantized model).
"""

from __future__ import annotations

import torch

from serve.attention import SeqChunk
from serve.model import DecoderModel, ForwardBatch


def decode_nll(model: DecoderModel, ids: list[int], block_size: int = 16) -> float:
    """Summed next-token NLL (nats) of `ids`, every position computed as a one-row decode step.

    Each KV block group (Gemma 3's sliding and full layers keep separate blocks) gets its own
    table over a disjoint range of the pool."""
    blocks = -(-len(ids) // block_size)
    groups = max(model.kv_layout.layer_group) + 1
    kv, total = model.new_kv_cache(blocks * groups, block_size), 0.0
    tables = [list(range(g * blocks, (g + 1) * blocks)) for g in range(groups)]
    for pos in range(len(ids) - 1):
        chunk = SeqChunk(0, 1, pos + 1, tables[0], tuple(tables[1:]))
        step = ForwardBatch(torch.tensor([ids[pos]]), torch.tensor([pos]), [chunk], torch.tensor([0]))
        logits = model.forward(step, kv)[0].double()
        total += float(torch.logsumexp(logits, 0) - logits[ids[pos + 1]])
    return total
