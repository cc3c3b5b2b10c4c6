"""Acceptance-rate metrics for speculative decoding, defined once (docs/metrics.md).

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) lets a cheap draft propose ``k``
tokens that the target verifies in one forward pass. A proposal ``x ~ q`` is kept with
probability ``min(1, p(x)/q(x))``; on rejection a token is drawn from ``norm(max(0, p - q))``;
when all ``k`` are kept the target's next distribution gives a bonus token. The output then
follows the target exactly, and the chance that one proposal is kept is

    alpha(context) = sum_v min(p(v), q(v)) = 1 - TV(p, q),

which at temperature 0 (one-hot p and q) is 1 when the two argmaxes agree and 0 otherwise.

This module gives three views of the same quantity for the stages (``distill.draft``). The
serving check (``serve.validate``) reads the engine's own counters instead (``serve/stats.py``:
serve may not import the core), which follow the same definitions (docs/metrics.md):

- :func:`analytic_acceptance`: mean ``sum min(p, q)`` over teacher-forced held-out text;
- :func:`speculative_generate` / :func:`empirical_acceptance`: an exact speculative-decoding loop
  over HF models (batch 1, KV caches cropped on rejection) that counts what was really kept;
- :func:`expected_speedup` with :func:`measure_cost_ratio`: what an acceptance rate buys once
  the draft's cost relative to the target (``c``) is known.

Two acceptance figures come out of a real run and are easy to confuse (vllm#9565):
``per_token_acceptance`` = kept / verified positions (a verified position is one whose earlier
proposals were all kept): it estimates ``alpha`` and is what the speedup formula takes.
``acceptance_rate`` = kept / proposed (vLLM's "draft acceptance rate"): it is smaller, because a
rejection wastes the rest of the window. Heavy libraries are imported inside functions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def expected_accepted_length(alpha: float, k: int) -> float:
    """Expected tokens emitted per target forward with i.i.d. acceptance ``alpha`` and window
    ``k``: ``(1 - alpha^(k+1)) / (1 - alpha)`` (it is ``k + 1`` at ``alpha = 1``)."""
    _check_alpha(alpha)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.'s expected wall-time improvement: tokens per target forward divided by
    the cost of one round, ``1 + k * c`` target-forward units (``c`` = draft/target cost)."""
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio: must be >= 0, got {cost_ratio}")
    return expected_accepted_length(alpha, k) / (1.0 + k * cost_ratio)


def best_window(alpha: float, cost_ratio: float, max_k: int = 8) -> tuple[int, float]:
    """The ``k`` in 1..max_k with the highest expected speedup, and that speedup."""
    return max(((k, expected_speedup(alpha, k, cost_ratio)) for k in range(1, max_k + 1)), key=lambda kv: kv[1])


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")


def probs(logits: "torch.Tensor", temperature: float) -> "torch.Tensor":
    """Sampling distribution at ``temperature`` in float32; 0 means greedy, i.e. one-hot argmax.

    Treating greedy decoding as one-hot distributions lets one rejection rule serve both
    cases: a greedy proposal is kept exactly when it is the target's argmax."""
    import torch

    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def overlap(p: "torch.Tensor", q: "torch.Tensor") -> "torch.Tensor":
    """``sum_v min(p, q)`` over the last axis: the chance one proposal from ``q`` is kept."""
    import torch

    return torch.minimum(p, q).sum(-1)


def _same_vocab(target: Any, draft: Any) -> None:
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(
            f"draft vocab_size {vd} != target vocab_size {vt}: speculative decoding needs the"
            " target's exact vocabulary (build the draft with distill.draft)"
        )


def analytic_acceptance(
    target: Any,
    draft: Any,
    sequences: Sequence[Sequence[int]],
    temperatures: Sequence[float] = (0.0, 1.0),
    max_length: int = 256,
    batch_size: int = 4,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Mean per-token acceptance ``sum min(p, q)`` over every position of held-out token
    sequences (teacher-forced), for each temperature.

    Teacher forcing on real text measures agreement in the contexts users send; the empirical
    loop below measures it in contexts the target itself writes. Float32 models run under bf16
    autocast where ``bf16`` says (None: where the device is fast at it, as scoring does,
    ``warsha.score_forward``). Returns
    ``{"t0": ..., "t1": ..., "positions": n}`` (keys ``t<temperature>``)."""
    import torch

    from warsha.score_forward import autocast_for

    _same_vocab(target, draft)
    seqs = [list(s)[:max_length] for s in sequences if len(s) >= 2]
    if not seqs:
        raise ValueError("sequences: need at least one sequence of 2 or more tokens")
    sums = {t: 0.0 for t in temperatures}
    count = 0
    with torch.inference_mode():
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start : start + batch_size]
            ids, mask = _pad(chunk)
            with autocast_for(target, ids.device, bf16):
                lt = target(input_ids=ids, attention_mask=mask).logits.float()
            with autocast_for(draft, ids.device, bf16):
                ld = draft(input_ids=ids, attention_mask=mask).logits.float()
            valid = mask.bool()
            for t in temperatures:
                sums[t] += float(overlap(probs(lt, t), probs(ld, t))[valid].sum())
            count += int(valid.sum())
    out: dict[str, Any] = {_tkey(t): sums[t] / count for t in temperatures}
    out["positions"] = count
    return out


def _tkey(t: float) -> str:
    return f"t{t:g}"


def _pad(chunk: list[list[int]]) -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    width = max(len(s) for s in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros(len(chunk), width, dtype=torch.long)
    for row, s in enumerate(chunk):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    return ids, mask


def verify(
    p: "torch.Tensor", q: "torch.Tensor", proposed: "torch.Tensor", generator: "torch.Generator"
) -> tuple[int, int]:
    """The exact speculative-sampling rule for one window.

    ``p``: target distributions ``[k + 1, V]`` (the last one is for the bonus token), ``q``:
    draft distributions ``[k, V]``, ``proposed``: the ``k`` draft tokens. Returns the number kept
    and the token emitted after them (a residual resample or the bonus token)."""
    import torch

    k = proposed.shape[0]
    for i in range(k):
        x = int(proposed[i])
        u = float(torch.rand((), generator=generator))
        if u * float(q[i, x]) < float(p[i, x]):  # u < p/q without dividing by a zero q
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


@dataclass
class SpecRun:
    """What one speculative generation did, round by round.

    ``kept`` holds, for every verified position, whether its proposal was kept, and
    ``overlaps`` the analytic ``sum min(p, q)`` at that exact context: their means must agree
    (the rule keeps a proposal with exactly that probability), which the tests check."""

    tokens: list[int]
    k: int
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    kept: list[bool] = field(default_factory=list)
    overlaps: list[float] = field(default_factory=list)


def _crop_to(cache: Any, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _step(model: Any, cache: Any, seq: list[int]) -> "torch.Tensor":
    """Feed the tokens of ``seq`` the cache has not seen; return the logits of the last one."""
    import torch

    done = cache.get_seq_length()
    ids = torch.tensor([seq[done:]], dtype=torch.long)
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()


def speculative_generate(
    target: Any,
    draft: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    k: int,
    temperature: float,
    generator: "torch.Generator",
) -> SpecRun:
    """Exact speculative decoding at batch 1 with HF models and KV caches.

    Each cache holds every committed token but the newest; a round feeds each model what its
    cache lacks, so after a rejection both caches are cropped back instead of recomputed. Stops
    after at least ``max_new_tokens`` (EOS is not special: the point is to count acceptance)."""
    import torch
    from transformers import DynamicCache

    _same_vocab(target, draft)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    seq = list(prompt)
    run = SpecRun(tokens=[], k=k)
    tcache, dcache = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        _prefill(target, tcache, seq)
        _prefill(draft, dcache, seq)
        while len(seq) - len(prompt) < max_new_tokens:
            proposed, q = _propose(draft, dcache, seq, k, temperature, generator)
            base = len(seq)
            ids = torch.tensor([seq[tcache.get_seq_length() :] + proposed.tolist()])
            lt = target(input_ids=ids, past_key_values=tcache, use_cache=True).logits[0, -(k + 1) :]
            p = probs(lt, temperature)
            n, nxt = verify(p, q, proposed, generator)
            _record(run, p, q, n)
            seq += proposed[:n].tolist() + [nxt]
            _crop_to(tcache, base + n)
            _crop_to(dcache, base + n)
    run.tokens = seq[len(prompt) :]
    return run


def _prefill(model: Any, cache: Any, seq: list[int]) -> None:
    """Cache every token but the last, so the first round has something to feed."""
    import torch

    if len(seq) < 1:
        raise ValueError("prompt: must hold at least one token (e.g. BOS)")
    if len(seq) > 1:
        model(input_ids=torch.tensor([seq[:-1]]), past_key_values=cache, use_cache=True)


def _propose(
    draft: Any, cache: Any, seq: list[int], k: int, temperature: float, generator: "torch.Generator"
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Draw ``k`` draft tokens autoregressively; return them and their distributions."""
    import torch

    work = list(seq)
    tokens, dists = [], []
    for _ in range(k):
        q = probs(_step(draft, cache, work), temperature)
        x = int(torch.multinomial(q, 1, generator=generator))
        tokens.append(x)
        dists.append(q)
        work.append(x)
    return torch.tensor(tokens), torch.stack(dists)


def _record(run: SpecRun, p: "torch.Tensor", q: "torch.Tensor", n: int) -> None:
    k = q.shape[0]
    run.rounds += 1
    run.proposed += k
    run.accepted += n
    for i in range(min(n + 1, k)):  # positions verified this round
        run.kept.append(i < n)
        run.overlaps.append(float(overlap(p[i], q[i])))


@dataclass
class SpecStats:
    """Totals over many speculative runs with one ``k`` and temperature."""

    k: int
    rounds: int
    proposed: int
    accepted: int
    verified: int
    analytic_on_visited: float
    tokens: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept over proposed draft tokens (vLLM's draft acceptance rate)."""
        return self.accepted / max(self.proposed, 1)

    @property
    def per_token_acceptance(self) -> float:
        """Kept over verified positions: the estimate of ``alpha``."""
        return self.accepted / max(self.verified, 1)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward (kept proposals + the one the target adds)."""
        return (self.accepted + self.rounds) / max(self.rounds, 1)

    def as_dict(self) -> dict[str, float]:
        """Manifest form."""
        return {
            "k": self.k,
            "acceptance_rate": self.acceptance_rate,
            "per_token_acceptance": self.per_token_acceptance,
            "analytic_on_visited": self.analytic_on_visited,
            "mean_accepted_length": self.mean_accepted_length,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verified": self.verified,
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
        }


def empirical_acceptance(
    target: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    ks: Sequence[int] = tuple(range(1, 9)),
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> dict[int, SpecStats]:
    """Run :func:`speculative_generate` on every prompt for every ``k`` and total the counts."""
    import torch

    out: dict[int, SpecStats] = {}
    for k in ks:
        g = torch.Generator().manual_seed(seed + k)
        start = time.perf_counter()
        runs = [speculative_generate(target, draft, p, max_new_tokens, k, temperature, g) for p in prompts]
        seconds = time.perf_counter() - start
        overlaps = [o for r in runs for o in r.overlaps]
        out[k] = SpecStats(
            k=k,
            rounds=sum(r.rounds for r in runs),
            proposed=sum(r.proposed for r in runs),
            accepted=sum(r.accepted for r in runs),
            verified=len(overlaps),
            analytic_on_visited=sum(overlaps) / max(len(overlaps), 1),
            tokens=sum(len(r.tokens) for r in runs),
            seconds=seconds,
        )
    return out


def plain_tokens_per_s(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, seed: int = 0
) -> float:
    """Decode speed of the target alone (batch 1, KV cache, same sampling) on the same
    prompts: the wall-clock reference a speculative run's ``tokens_per_s`` is compared with."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            seq, cache = list(prompt), DynamicCache()
            _prefill(model, cache, seq)
            for _ in range(max_new_tokens):
                q = probs(_step(model, cache, seq), temperature)
                seq.append(int(torch.multinomial(q, 1, generator=g)))
            tokens += max_new_tokens
    return tokens / max(time.perf_counter() - start, 1e-9)


def measure_cost_ratio(
    target: Any, draft: Any, context: int = 64, repeats: int = 20, vocab_limit: int | None = None
) -> dict[str, float]:
    """Median wall time of one decode step (batch 1, one token on a cache of ``context``
    tokens) for each model, and ``c`` = draft / target: the cost the speedup formula needs.

    A decode step is what speculation multiplies; a prefill or training step would flatter a
    draft whose cost is the embedding and head, which at tiny sizes is most of the model."""
    import torch

    vocab = vocab_limit or target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=g).tolist()[0]
    t_ms = _decode_ms(target, prefix, repeats)
    d_ms = _decode_ms(draft, prefix, repeats)
    return {"target_ms": t_ms, "draft_ms": d_ms, "cost_ratio": d_ms / t_ms}


def _decode_ms(model: Any, prefix: list[int], repeats: int) -> float:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    times = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([prefix[:-1]]), past_key_values=cache, use_cache=True)
        last = torch.tensor([prefix[-1:]])
        for i in range(repeats + 3):
            start = time.perf_counter()
            model(input_ids=last, past_key_values=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            _crop_to(cache, len(prefix) - 1)
            if i >= 3:  # warm-up steps are dropped
                times.append(elapsed * 1000.0)
    return statistics.median(times)
