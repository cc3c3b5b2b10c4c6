"""Next-token losses of the training stages, with the LM head and cross-entropy fused.

Why fused: in the models these recipes adapt, the vocabulary projection is most of a training
step (a 48k-row head on a hidden-256 model is four fifths of its FLOPs), and the unfused path
makes many passes over the ``[tokens, vocab]`` float32 logits besides its three GEMMs:
log-softmax forward, a zero-filled gradient and its scatter, log-softmax backward (which
recomputes the exponentials). ``linear_cross_entropy`` computes the gradient of the loss with
respect to the logits while they are still in hand (softmax minus one-hot, one exponential per
logit), turns it into the hidden-state and weight gradients with two GEMMs, and never keeps the
logits: the backward only scales the saved gradients. Rows are processed in chunks, so peak
memory is bounded by ``CHUNK_ELEMENTS`` logits whatever the batch, as in Liger-Kernel's fused
linear cross-entropy.

The fused path needs the head as a plain weight: models wrapped for data parallelism
(DDP, DeepSpeed, FSDP expose ``.module``), biased heads, heads wrapped by peft other than its
trainable-token rows, and families that transform logits after the head (softcapping, logit
scales) take the model's own forward. peft's trainable tokens (the adapt stage's new rows) are
fused: the head's weight is the base weight with the trained rows written in, as peft's own
forward builds it, so without fusing the extended model materialized ``[tokens, vocab]`` logits
and trained at a third of the unextended model's speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 26  # logits per chunk: 256 MB in float32
IGNORE_INDEX = -100  # label value that scores nothing (transformers' convention)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    groups: ColumnGroups | None = None,
) -> torch.Tensor:
    """``sum_i weights[i] * CE(hidden[i] @ weight.T, targets[i]) / sum(weights)``, fused.

    ``hidden`` [N, H], ``weight`` [V, H] (an ``nn.Linear`` weight without bias), ``targets`` [N]
    int64, ``weights`` [N] (0 drops a row). Logits are formed in float32; gradients come back
    in the inputs' dtypes. Soft labels: ``targets`` [N, K] with ``target_probs`` [N, K], each row
    summing to 1 (a teacher's top-K renormalised): the row's loss is the cross-entropy against
    that distribution, which differs from the KL divergence by the teacher's entropy only. With
    ``groups``, a target names a group of logit columns and its probability is the group's
    summed probability (``ColumnGroups``).
    """
    return _LinearCrossEntropy.apply(hidden, weight, targets, weights, None, None, target_probs, groups)


def linear_cross_entropy_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    row_values: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    groups: ColumnGroups | None = None,
) -> torch.Tensor:
    """``linear_cross_entropy`` with a head whose rows ``rows`` hold ``row_values`` (``weight``
    already holds them too), differentiable in ``row_values`` only.

    Why: when only a few rows of a large head train (the adapt stage's 16,000 new pieces of a
    278k-row head), the weight gradient is needed for those rows alone; the full-matrix gradient
    costs as much as the logits themselves and is then mostly discarded.
    """
    return _LinearCrossEntropy.apply(hidden, weight.detach(), targets, weights, rows, row_values, target_probs, groups)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when asked for, both gradients; backward scales them.

    ``targets`` is [N] (one label per row) or [N, K] with ``target_probs`` [N, K] (a soft label
    per row: the row's loss is ``sum_k p_k * CE(logits, t_k)``, a cross-entropy against a
    sparse teacher distribution)."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any,
        hidden: Any,
        weight: Any,
        targets: Any,
        weights: Any,
        rows: Any,
        row_values: Any,
        target_probs: Any,
        groups: Any,
    ) -> Any:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[5]
        ctx.rows_only = rows is not None
        scale = weights.float() / weights.float().sum()
        if targets.dim() == 1:
            targets, target_probs = targets[:, None], torch.ones(len(targets), 1, device=hidden.device)
        target_probs = target_probs.float()
        grad_h = torch.empty_like(hidden) if want_h else None
        w_shape = (len(rows), weight.shape[1]) if rows is not None else weight.shape
        grad_w = torch.zeros(w_shape, dtype=torch.float32, device=weight.device) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(weight.shape[0])
        for s in range(0, hidden.shape[0], step):
            e = min(s + step, hidden.shape[0])
            h, t, q, w = hidden[s:e], targets[s:e], target_probs[s:e], scale[s:e, None]
            logits = torch.mm(h, weight.t()).float()
            if groups is None:
                probs, nll = _chunk_loss(logits, t, q)
                probs.scatter_add_(1, t, -q)  # softmax - target distribution: d nll / d logits
            else:
                probs, nll = groups.loss_and_grad(logits, t, q)
            loss += (nll * w.squeeze(1)).sum()
            if grad_h is None and grad_w is None:
                continue
            # the row weights scale the GEMMs' small operands and outputs, not the [rows, vocab] block
            if grad_h is not None:
                grad_h[s:e] = torch.mm(probs.to(weight.dtype), weight).mul_(w.to(weight.dtype))
            if grad_w is not None:
                d_logits = probs if rows is None else probs.index_select(1, rows)
                grad_w.addmm_(d_logits.t(), h.float() * w)
        w_dtype = weight.dtype if rows is None else row_values.dtype
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(w_dtype))
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:  # noqa: D102
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad.to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w * grad.to(grad_w.dtype)
        if ctx.rows_only:
            return grad_h, None, None, None, None, grad_w, None, None
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_loss(
    logits: torch.Tensor, targets: torch.Tensor, probs_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``logits`` (their buffer is reused) and the per-row cross-entropy against the
    targets ``targets`` [rows, K] with probabilities ``probs_k`` [rows, K] (K = 1, p = 1: the NLL).

    One fused softmax pass replaces the subtract / exponentiate / sum / divide passes over the
    ``[rows, vocab]`` block, which on a CPU are bound by memory (the block is far larger than the
    caches). The log-normaliser comes back from the softmax itself: at a row's largest logit the
    probability is ``1 / sum(exp(logit - peak))``, which is at least ``1 / vocab`` and so never
    underflows, whatever the target's probability.
    """
    target_logit = (logits.gather(1, targets) * probs_k).sum(1)
    peak, where = logits.max(-1, keepdim=True)
    probs = _softmax_(logits)
    lse = peak.squeeze(1) - probs.gather(1, where).squeeze(1).log()
    return probs, lse - target_logit


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in place on CPU, where torch's last-dimension kernel reads
    each row before writing it (tests/warsha/test_lm_loss.py checks it against float64); a copy
    elsewhere."""
    return torch.softmax(logits, -1, out=logits) if logits.device.type == "cpu" else torch.softmax(logits, -1)


TINY_MASS = 1e-30
"""A group's probability is floored here before its log: a target the model gives no mass
costs ``-log(1e-30)`` and passes no gradient, instead of an infinite loss."""


@dataclass(frozen=True)
class ColumnGroups:
    """Targets that name groups of logit columns: target ``b`` (below ``size``) is column ``b``
    together with the columns ``members`` whose entry in ``of`` is ``b``; a column at or past
    ``size`` that is no member belongs to no target.

    Why: an extended vocabulary writes a base token either as itself or as a longer new piece
    that starts with it; a teacher over base tokens scores the group's summed probability
    (``tokenizer_ext.cross_tok``). In the fused loss the gradient of ``-sum_k p_k log Q_k``
    with respect to a column ``u`` of group ``g`` is ``q_u * (sum_k p_k - p_g / Q_g)``, where
    ``p_g`` sums the ``p_k`` of the targets naming ``g`` (0 for a group none names); it is formed
    while the chunk's softmax is in hand: no second forward through the head in the backward.
    """

    size: int
    members: torch.Tensor  # int64 [M]: columns at or past ``size`` that belong to a group
    of: torch.Tensor  # int64 [M]: the group (a column below ``size``) of each member

    def loss_and_grad(
        self, logits: torch.Tensor, targets: torch.Tensor, probs_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d loss / d logits in ``logits``' buffer, the per-row loss) of one chunk; ``targets``
        [rows, K] are groups, ``probs_k`` [rows, K] their probabilities."""
        probs = _softmax_(logits)
        member_p = probs.index_select(1, self.members)
        coef = probs.new_zeros(probs.shape[0], self.size).index_add_(1, self.of, member_p)
        mass = probs.gather(1, targets) + coef.gather(1, targets)
        nll = -(mass.clamp_min(TINY_MASS).log() * probs_k).sum(1)
        ratio = torch.where(mass > TINY_MASS, probs_k / mass.clamp_min(TINY_MASS), 0.0)
        total = probs_k.sum(1, keepdim=True)
        coef = coef.zero_().scatter_add_(1, targets, ratio).neg_().add_(total)  # sum_k p_k - p_g / Q_g
        probs[:, self.size :].mul_(total)
        probs[:, : self.size].mul_(coef)
        return probs.index_copy_(1, self.members, member_p.mul_(coef.index_select(1, self.of))), nll


class TrainableTokensHead:
    """A peft trainable-tokens head seen as a plain one: ``weight`` is the base weight with the
    adapter's rows written in (differentiable in those rows), exactly the matrix its forward uses."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    @property
    def weight(self) -> torch.Tensor:
        layer = self.layer
        if layer.merged or layer.disable_adapters or not layer.active_adapters:
            return layer.base_layer.weight
        return layer.get_merged_weights(layer.active_adapters)

    def trained_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row ids, their trainable values) of the one active adapter, or None (adapters off,
        merged, or several active: then ``weight`` alone is right)."""
        layer = self.layer
        active = layer.active_adapters
        if layer.merged or layer.disable_adapters or len(active) != 1:
            return None
        values = layer.trainable_tokens_delta[active[0]]
        ids = torch.as_tensor(layer.token_indices[active[0]], dtype=torch.long, device=values.device)
        return ids, values


def head_loss(
    hidden: torch.Tensor,
    head: Any,
    targets: torch.Tensor,
    weights: torch.Tensor,
    target_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused loss against ``head`` (from ``plain_head``), hard or soft labels; a
    trainable-tokens head's weight gradient is formed for its trained rows only."""
    trained = head.trained_rows() if isinstance(head, TrainableTokensHead) else None
    if trained is None or not trained[1].requires_grad:
        return linear_cross_entropy(hidden, head.weight, targets, weights, target_probs)
    ids, values = trained
    return linear_cross_entropy_rows(hidden, head.weight, ids, values, targets, weights, target_probs)


def soft_lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the model's next-token distributions against a sparse teacher's.

    ``batch``: ``input_ids`` [B, L], ``teacher_ids`` [B, L-1, K] and ``teacher_probs``
    [B, L-1, K] (rows summing to 1): at position t the teacher's top-K next tokens after
    ``input_ids[:, :t+1]``. Minimising it minimises KL(teacher || model) on the teacher's top-K.
    """
    ids, t_ids, t_probs = batch["input_ids"], batch["teacher_ids"], batch["teacher_probs"]
    parts = plain_head(model)
    if parts is None:
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        return -(logp.gather(-1, t_ids) * t_probs).sum(-1).mean()
    decoder, head = parts
    hidden = decoder(input_ids=ids).last_hidden_state[:, :-1]
    flat, k = hidden.reshape(-1, hidden.shape[-1]), t_ids.shape[-1]
    ones = torch.ones(flat.shape[0], device=flat.device)
    return head_loss(flat, head, t_ids.reshape(-1, k).to(flat.device), ones, t_probs.reshape(-1, k).to(flat.device))


def _plain_linear(head: Any) -> bool:
    return type(head) is torch.nn.Linear and head.bias is None and not hasattr(head.weight, "ds_id")


def _fusable_head(head: Any) -> Any | None:
    """The head itself, its trainable-tokens view, or None when only its forward is right."""
    if _plain_linear(head):
        return head
    head = getattr(head, "token_adapter", head)  # peft's wrapper forwards to its token layer, on or off
    if callable(getattr(head, "get_merged_weights", None)) and _plain_linear(getattr(head, "base_layer", None)):
        return TrainableTokensHead(head)
    return None


def plain_head(model: Any) -> tuple[Any, Any] | None:
    """(decoder, head) when the fused loss may bypass the model's forward, else None; ``head``
    has the ``weight`` the model's forward multiplies by."""
    if hasattr(model, "module") or not hasattr(model, "get_decoder"):
        return None  # a data-parallel wrapper must be called as a whole, or gradients never sync
    head = _fusable_head(model.get_output_embeddings())
    config = getattr(model, "config", None)
    if head is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    return model.get_decoder(), head


TRAINED_ROWS = "warsha_trained_rows"


def mark_trained_rows(weight: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weight``, which already holds ``values`` at ``rows``, marked so that the fused losses
    (``trained_rows``) form its gradient for those rows only, into ``values``.

    Why: a head assembled from frozen rows and a few trained ones (``tokenizer_ext.row_map``:
    8,000 mapped rows of 270,144) would otherwise get a float32 gradient over every row, as much
    arithmetic as its logits, all but 3% of it then discarded."""
    setattr(weight, TRAINED_ROWS, (rows, values))
    return weight


def trained_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row ids, their differentiable values) of a weight ``mark_trained_rows`` marked, else None."""
    return getattr(weight, TRAINED_ROWS, None)


def hidden_and_head(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """Final hidden states and the head weight the model multiplies them by (a plain head,
    ``plain_head``), or ``(None, logits)`` where only the model's own forward is right."""
    parts = plain_head(model)
    if parts is None:
        return None, model(input_ids=ids, attention_mask=mask).logits
    decoder, head = parts
    return head.weight, decoder(input_ids=ids, attention_mask=mask).last_hidden_state


def causal_lm_loss(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The next-token loss (labels are the inputs unless the batch has ``labels``; -100 scores
    nothing); weighted per target when the batch carries ``loss_weights`` (see ``weighted_lm_loss``)."""
    if "loss_weights" in batch:
        return weighted_lm_loss(model, batch)
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    parts = plain_head(model)
    if parts is None:
        return model(input_ids=ids, labels=labels).loss
    decoder, head = parts
    hidden = decoder(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:].to(hidden.device)
    keep = targets != IGNORE_INDEX
    return head_loss(hidden[keep], head, targets[keep], keep[keep].float())


def weighted_lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss with per-target weights (``loss_weights[t]`` weighs predicting token t).

    With every weight 1 this is the plain causal-LM loss. Weights above 1 (a passkey's answer)
    give the few tokens that carry a rare signal a voice; weight 0 drops a target (the first
    copy of a repeated span, which nothing predicts). The LM head runs only on targets with a
    non-zero weight: with a 48k vocabulary it is four fifths of the tiny model's FLOPs, so
    scoring only the copy targets and the answer makes such a row several times cheaper.
    """
    ids = batch["input_ids"]
    weights = batch["loss_weights"][:, 1:].to(ids.device)
    parts = plain_head(model)
    if parts is None:
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
        w = weights.reshape(-1).to(nll.dtype)
        return (nll * w).sum() / w.sum()
    decoder, head = parts
    hidden = decoder(input_ids=ids).last_hidden_state[:, :-1]
    keep = weights > 0
    return head_loss(hidden[keep], head, ids[:, 1:][keep], weights[keep])
