"""Token-level divergences between the target (teacher) and the draft (student).

All four act on full-vocabulary distributions at a temperature ``T`` (teacher ``p``, student
``q``), per position, averaged over the positions a mask selects:

- ``fkl``: KL(p || q), mass-covering: the student must put mass everywhere the teacher does;
- ``rkl``: KL(q || p), mode-seeking: the student may drop teacher modes it cannot fit;
- ``tvd``: 0.5 * sum |p - q|. Since ``sum min(p, q) = 1 - TVD``, minimising it maximises the
  speculative acceptance rate at temperature T directly (DistillSpec's observation);
- ``jsd``: 0.5 KL(p || m) + 0.5 KL(q || m) with m = (p + q) / 2, bounded and symmetric.

The KL-type losses are multiplied by ``T^2`` (Hinton et al.), which keeps gradient sizes
comparable when the temperature changes; TVD is left as a probability, so its value reads as
"1 - acceptance". Everything is computed in float32 whatever the autocast dtype of the logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Divergence = Literal["fkl", "rkl", "tvd", "jsd"]
DIVERGENCES: tuple[str, ...] = ("fkl", "rkl", "tvd", "jsd")


def token_divergence(
    student_logits: "torch.Tensor",
    teacher_logprobs: "torch.Tensor",
    kind: str,
    temperature: float = 1.0,
) -> "torch.Tensor":
    """Per-position divergence ``[...]`` between student logits and teacher log-probabilities
    (already at ``temperature``; see :func:`teacher_logprobs`)."""
    import torch

    if kind not in DIVERGENCES:
        raise ValueError(f"loss: must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = teacher_logprobs.float()
    p, q = log_p.exp(), log_q.exp()
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "fkl":
        out = _kl(p, log_p, log_q)
    elif kind == "rkl":
        out = _kl(q, log_q, log_p)
    else:
        log_m = torch.logsumexp(torch.stack([log_p, log_q]), dim=0) - math.log(2.0)
        out = 0.5 * _kl(p, log_p, log_m) + 0.5 * _kl(q, log_q, log_m)
    return out * temperature**2


def _kl(a: "torch.Tensor", log_a: "torch.Tensor", log_b: "torch.Tensor") -> "torch.Tensor":
    """sum a (log a - log b), with 0 log 0 = 0 (a teacher may put zero mass on a token)."""
    import torch

    terms = a * (log_a - log_b)
    return torch.where(a > 0, terms, torch.zeros_like(terms)).sum(-1)


def teacher_logprobs(teacher_logits: "torch.Tensor", temperature: float) -> "torch.Tensor":
    """Teacher log-probabilities at ``temperature`` in float32."""
    import torch

    return torch.log_softmax(teacher_logits.float() / temperature, dim=-1)


def masked_mean(values: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """Mean of ``values`` where ``mask`` is true (the positions a batch trains on)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def compress_topk(logprobs: "torch.Tensor", k: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Keep the ``k`` largest teacher log-probabilities per position (for the optional cache).

    Storing ``k`` of ~48k values per token is what makes caching teacher outputs affordable;
    :func:`expand_topk` spreads the dropped mass uniformly, so every divergence stays finite."""
    vals, idx = logprobs.topk(k, dim=-1)
    return vals.to(dtype=logprobs.dtype), idx.to(dtype=_index_dtype(logprobs.shape[-1]))


def expand_topk(vals: "torch.Tensor", idx: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """Full log-probabilities from a top-k cache: the cached ones, and the rest of the mass
    split evenly over the other ``vocab - k`` tokens."""

    vals = vals.float()
    kept = vals.exp().sum(-1, keepdim=True).clamp(max=1.0)
    rest = (1.0 - kept).clamp(min=1e-12) / max(vocab - vals.shape[-1], 1)
    out = rest.log().expand(*vals.shape[:-1], vocab).clone()
    return out.scatter(-1, idx.long(), vals)


def _index_dtype(vocab: int) -> "torch.dtype":
    import torch

    return torch.int32 if vocab > 32767 else torch.int16
