"""One scoring forward: the summed NLL of each row's scored targets, the head run only where it counts.

Why: every bits-per-character figure of the real recipe costs a forward over a 262k-278k-row
head, two thirds of a scored token's multiply-adds, and the float32 logits of a batch of 8 x 256
positions are 2.2 GiB that the log-softmax then reads twice. Where the model's head is a plain
weight (``warsha.lm_loss.hidden_and_head``, the same test the fused training loss uses), the
decoder runs alone and the head is applied to the scored positions only (a sliding window's
context half is never projected): a few hundred positions and ``VOCAB_SLICE`` head rows at a
time, each slice's log-sum-exp taken while its logits are in cache, the slices combined at the
end. Other models (a soft-capped or biased head, a data-parallel wrapper) are scored through
their whole logits, as before.

On a CPU or GPU with fast bf16 (``warsha.precision``) a float32 model is scored under bf16
autocast. On a 2-core Zen 4 host with Gemma 3 270M and 8 x 256 positions, whole float32 logits
took 9.2-9.8 s and this path in bf16 takes 4.6 s. The NLLs move by about 1e-3 relative, a
tenth of the smallest paired standard error the stages report (docs/metrics.md, "Scoring
precision").
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from warsha.lm_loss import hidden_and_head

NLL_POSITIONS = 256
"""Scored positions per chunk of the head."""

VOCAB_SLICE = 16384
"""Head rows per slice: 256 positions' float32 logits of a slice are 16 MiB."""


def autocast_for(model: Any, device: torch.device, bf16: bool | None = None) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for a float32 model where ``bf16`` (None: where the device is fast at it,
    ``warsha.precision``) says so; the model as loaded otherwise (float64 references stay exact)."""
    from warsha.precision import use_bf16

    param = next(model.parameters(), None)
    if param is None or param.dtype != torch.float32 or not use_bf16(bf16, device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)  # weights may change between calls


def scoring_dtype(model: Any, bf16: bool | None = None) -> str:
    """The dtype the scoring matmuls run in (for reports): bfloat16 under autocast, else the model's."""
    param = next(model.parameters())
    with autocast_for(model, param.device, bf16):
        enabled = torch.is_autocast_enabled(param.device.type)
    return "bfloat16" if enabled else str(param.dtype).removeprefix("torch.")


def rows_nll(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor, bf16: bool | None = None
) -> torch.Tensor:
    """float64 [rows]: summed NLL (nats) of each row's targets (``target`` [rows, width - 1],
    -100 where not scored) after a right-padded forward of ``input_ids`` under ``mask``."""
    with autocast_for(model, input_ids.device, bf16):
        weight, out = hidden_and_head(model, input_ids, mask)
        if weight is None:
            return _whole_logits_nll(out, target)
        return _scored_nll(out, _matmul_weight(weight), target)


def _matmul_weight(weight: torch.Tensor) -> torch.Tensor:
    """The head's weight in the dtype its matmul runs in: cast once per forward under autocast
    (autocast would cast it again for every slice of every chunk), as it is otherwise."""
    kind = weight.device.type
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return weight.detach().to(torch.get_autocast_dtype(kind))
    return weight.detach()


def _scored_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the NLL of its scored targets, the head applied to those positions only."""
    rows, pos = (target != -100).nonzero(as_tuple=True)
    total = torch.zeros(target.shape[0], dtype=torch.float64, device=hidden.device)
    for at in range(0, rows.numel(), NLL_POSITIONS):
        r, p = rows[at : at + NLL_POSITIONS], pos[at : at + NLL_POSITIONS]
        total.index_add_(0, r, _sliced_nll(hidden[r, p].to(weight.dtype), weight, target[r, p]).double())
    return total


def _sliced_nll(h: torch.Tensor, weight: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """log-sum-exp minus the target's logit, the vocabulary a slice at a time (``_sliced_lse``)."""
    lse, picked = _sliced_lse(h, weight, tgt=tgt)
    return lse[:, 0] - picked


def _sliced_lse(
    h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None, tgt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position, the log-sum-exp of its logits over the whole vocabulary (column 0) and, with
    ``rows`` (bool [vocab]), over the rows it marks (column 1); with ``tgt``, the target's logit.

    Each slice's logits are reduced while in cache and the slices' log-sum-exps combined at the
    end: never a whole row of logits."""
    slices = range(0, weight.shape[0], VOCAB_SLICE)
    acc_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    cols = 1 if rows is None else 2
    lse = torch.empty(h.shape[0], cols, len(slices), dtype=acc_dtype, device=h.device)
    picked = None if tgt is None else torch.zeros(h.shape[0], dtype=acc_dtype, device=h.device)
    for i, v0 in enumerate(slices):
        v1 = min(v0 + VOCAB_SLICE, weight.shape[0])
        logits = (h @ weight[v0:v1].T).to(acc_dtype)  # a low-precision log-softmax loses bits
        lse[:, 0, i] = torch.logsumexp(logits, dim=-1)
        if rows is not None:
            lse[:, 1, i] = torch.logsumexp(logits.masked_fill(~rows[v0:v1], float("-inf")), dim=-1)
        if tgt is not None:
            at = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            picked = torch.where((tgt >= v0) & (tgt < v1), logits.gather(-1, at).squeeze(-1), picked)
    return torch.logsumexp(lse, dim=-1), picked


def rows_probability(model: Any, input_ids: torch.Tensor, rows: torch.Tensor, bf16: bool | None = None) -> torch.Tensor:
    """float64 [width - 1]: at each position of one unpadded row ``input_ids`` [1, width], the
    probability the model gives the next token being one of ``rows`` (bool [vocab]).

    The same forward as ``rows_nll`` (decoder alone, the head a vocabulary slice at a time, bf16
    where fast): the probability is exp(log-sum-exp over ``rows`` - log-sum-exp over all)."""
    with autocast_for(model, input_ids.device, bf16):
        weight, out = hidden_and_head(model, input_ids)
        if weight is None:
            logits = out[0, :-1].double()
            masked = logits.masked_fill(~rows[: logits.shape[-1]], float("-inf"))
            return (masked.logsumexp(-1) - logits.logsumexp(-1)).exp()
        weight = _matmul_weight(weight)
        hidden = out[0, :-1].to(weight.dtype)
        parts = [
            _sliced_lse(hidden[at : at + NLL_POSITIONS], weight, rows[: weight.shape[0]])[0]
            for at in range(0, hidden.shape[0], NLL_POSITIONS)
        ]
    lse = torch.cat(parts).double()
    return (lse[:, 1] - lse[:, 0]).exp()


def _whole_logits_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same sums from the model's logits at every position, a chunk of positions at a time."""
    total = torch.zeros(target.shape[0], dtype=torch.float64, device=logits.device)
    for at in range(0, target.shape[1], NLL_POSITIONS):
        tgt = target[:, at : at + NLL_POSITIONS]
        part = logits[:, at : at + tgt.shape[1]]
        part = part.float() if part.dtype in (torch.bfloat16, torch.float16) else part
        picked = part.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total += ((torch.logsumexp(part, dim=-1) - picked) * (tgt != -100)).sum(dim=1).double()
    return total
