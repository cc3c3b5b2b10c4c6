"""Training data for distillation: corpus chunks (off-policy) and sampled continuations
(on-policy).

Off-policy data is the corpus itself, both languages, train split only, packed into
fixed-length chunks. On-policy data are continuations sampled *while training* from corpus
prompts, by the draft (the contexts the draft will actually create at serving time, DistillSpec's
recommendation), by the target (the contexts speculative decoding actually verifies), or by
either at random. Which batch a step sees is a pure function of ``(seed, step)``, so a resumed
run draws exactly the batches the killed run would have drawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Pools:
    """Token chunks for off-policy batches and equal-length prompts for on-policy ones."""

    chunks: "torch.Tensor"  # [n, seq_len]
    prompts: "torch.Tensor"  # [m, prompt_len]


def encode_docs(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, prefixed with BOS when the tokenizer has one."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def build_pools(docs: Sequence[Sequence[int]], seq_len: int, prompt_len: int, seed: int) -> Pools:
    """Pack documents into ``seq_len`` chunks (the tail that does not fill one is dropped) and
    take each long-enough document's opening ``prompt_len`` tokens as a prompt."""
    import torch

    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)  # interleave languages and collections
    stream = [t for i in order for t in docs[i]]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(
            f"seq_len: the training text holds {len(stream)} tokens, fewer than one chunk of"
            f" {seq_len}; lower seq_len or use more documents"
        )
    chunks = torch.tensor(stream[: n * seq_len]).view(n, seq_len)
    prompts = [list(docs[i][:prompt_len]) for i in order if len(docs[i]) >= prompt_len]
    if not prompts:
        raise ValueError(f"prompt_len: no training document has {prompt_len} tokens; lower prompt_len")
    return Pools(chunks=chunks, prompts=torch.tensor(prompts))


def step_rng(seed: int, step: int, stream: str) -> random.Random:
    """A random source owned by one step and one purpose (resume-safe)."""
    return random.Random(f"{seed}:{step}:{stream}")


def off_policy_batch(pools: Pools, step: int, batch_size: int, seed: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Corpus chunks for ``step`` and the mask of positions to train (all of them)."""
    import torch

    rng = step_rng(seed, step, "off")
    idx = [rng.randrange(pools.chunks.shape[0]) for _ in range(batch_size)]
    ids = pools.chunks[idx]
    return ids, torch.ones_like(ids, dtype=torch.bool)


def on_policy_batch(
    sampler: Any,
    pools: Pools,
    step: int,
    batch_size: int,
    gen_len: int,
    temperature: float,
    seed: int,
    columns: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Prompts for ``step`` continued by ``sampler``; the mask selects the positions whose
    next-token distribution conditions on sampled text (the last prompt token onwards).
    ``columns``: the vocabulary id of each logit column when the sampler's head is restricted."""
    import torch

    rng = step_rng(seed, step, "on")
    idx = [rng.randrange(pools.prompts.shape[0]) for _ in range(batch_size)]
    prompts = pools.prompts[idx]
    gen = torch.Generator().manual_seed(rng.randrange(2**62))
    ids = sample(sampler, prompts, gen_len, temperature, gen, columns)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, prompts.shape[1] - 1 : -1] = True
    return ids, mask


def sample(
    model: Any,
    prompts: "torch.Tensor",
    new_tokens: int,
    temperature: float,
    generator: "torch.Generator",
    columns: "torch.Tensor | None" = None,
) -> "torch.Tensor":
    """Ancestral sampling of exactly ``new_tokens`` per row with a KV cache (no EOS stop, so
    every row has the same length and the batch needs no padding). A model whose head covers
    only some ids (``distill.draft_vocab.restrict_head``) samples among them: ``columns`` maps
    its logit columns back to vocabulary ids, as serve maps its restricted draft's."""
    import torch
    from transformers import DynamicCache

    from warsha.sampling import draw

    was_training = model.training
    model.eval()
    cache = DynamicCache()
    out = prompts
    step_in = prompts
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(input_ids=step_in, past_key_values=cache, use_cache=True).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = draw(torch.softmax(logits / temperature, -1), generator)
            if columns is not None:
                nxt = columns[nxt]
            out = torch.cat([out, nxt], dim=1)
            step_in = nxt
    model.train(was_training)
    return out.clone()
