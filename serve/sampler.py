"""Sampling: parameters, logits processing, per-request seeded draws, logprobs.

All rows of a step are processed together: temperature, top-k and top-p are applied as batched
tensor ops (on the CPU, top-k and top-p rank each row's best 1,024 tokens, widening only for
rows whose nucleus reaches past them: `top_k_top_p`); only penalties, which need each request's history,
touch rows one by one, and only for the requests that asked for them. Draws invert each row's
cumulative distribution at one uniform number (`sample`): exact, and one random number per row
instead of one per vocabulary entry, which on a 262k-token vocabulary was most of a sampled
step's sampling cost. Each seeded request
draws from its own generator, so a seed reproduces regardless of batch composition.

Everything runs on the logits' device. The random draws come from CPU generators (one number
per row, staged to the device), so a seed gives the same draws on every device; which filters
run is decided from the request parameters on the host (`LogitsPlan`), never by reading a
device tensor back; the sampled ids are the one read-back (`serve.device_io`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from serve import cpu_kernels, device_io

MIN_TEMPERATURE = 1e-5  # below this, temperature is treated as 0 (greedy), as vLLM does: 1/T overflows
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; the engine also checks top_k against its own vocabulary


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the parameter.

    Every float must be finite (NaN and infinities are refused, never propagated into logits);
    a temperature in (0, MIN_TEMPERATURE) is treated as 0 (greedy), because dividing logits by
    it overflows to inf/NaN; `seed` must fit torch's signed 64-bit generator seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive vocabulary rank, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax."""
        return self.temperature == 0

    @property
    def argmax_only(self) -> bool:
        """True when the next token is the argmax of the raw logits and nothing else reads them
        (greedy, no penalties, no logprobs): the engine may then screen the head (serve.head_screen)."""
        return self.greedy and not self.has_penalties and self.logprobs is None

    @property
    def gumbel_sampled(self) -> bool:
        """True when the token is a plain draw from softmax(logits / T): no top-k, top-p, penalties
        or logprobs. On the CPU the engine then draws it as argmax(logits / T + Gumbel noise)
        (`gumbel_noise`), which a screened head finds from a few rows (serve.head_screen)."""
        plain = self.top_p == 1 and self.top_k <= 0 and not self.has_penalties and self.logprobs is None
        return not self.greedy and plain

    @property
    def has_penalties(self) -> bool:
        """True when logits depend on the request's history."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for [rows, V] logits; float32 CPU rows take serve's kernel. An
    argmax-only forward may hand over each row's argmax already, int64 [rows] (the batch head
    screen, `serve.head_screen`): that is returned as it is.

    Why: greedy decoding reads every logit once, and torch's CPU argmax ran at about 4 GB/s
    (12 ms for 40 rows of a 278k vocabulary); the kernel gives the same index (first maximum,
    first NaN) at memory speed.
    """
    if logits.dim() == 1 and logits.dtype == torch.long:
        return logits
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(-1)


@dataclass(frozen=True)
class LogitsPlan:
    """Which passes `process_logits` makes, known on the host from the request parameters."""

    scale: bool  # some row's temperature is neither 0 nor 1
    filter: bool  # some row has top-k below the vocabulary or top-p below 1
    greedy: bool  # some row is greedy

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int) -> LogitsPlan:
        """The plan for rows sampled with `params` over a `vocab`-entry vocabulary."""
        return cls(
            scale=any(p.temperature not in (0, 1) for p in params),
            filter=any(0 < p.top_k < vocab or p.top_p < 1 for p in params),
            greedy=any(p.greedy for p in params),
        )

    @classmethod
    def read(cls, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> LogitsPlan:
        """The plan read from parameter tensors (reads them back: for callers without params)."""
        greedy = temperature == 0
        return cls(
            scale=bool(((temperature != 1) & ~greedy).any()),
            filter=bool(((top_k > 0) & (top_k < vocab)).any() or (top_p < 1).any()),
            greedy=bool(greedy.any()),
        )


@dataclass
class SampleResult:
    """Sampled tokens and, where asked, their logprobs (raw model distribution)."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None]


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """Repetition (HF/CTRL rule over prompt + output) and OpenAI frequency/presence penalties."""
    for row, p in enumerate(params):
        if not p.has_penalties:
            continue
        x = logits[row]
        if p.repetition_penalty != 1:
            seen = device_io.tensor(sorted(set(prompts[row]) | set(outputs[row])), torch.long, x.device)
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if outputs[row] and (p.frequency_penalty or p.presence_penalty):
            history = device_io.tensor(outputs[row], torch.long, x.device)  # scatter: bincount has no fixed shape
            counts = torch.zeros_like(x).scatter_add_(0, history, torch.ones(len(outputs[row]), device=x.device))
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return logits


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    plan: LogitsPlan | None = None,
) -> torch.Tensor:
    """Temperature, then top-k, then top-p, batched; returns probabilities [B, V].

    Rows with temperature 0 become one-hot on the argmax, so greedy and sampled requests share
    one code path (the rejection sampler then reduces to exact greedy matching). Parameter
    tensors live on the logits' device; `plan` (None: read from them) skips passes no row needs.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    plan = plan or LogitsPlan.read(temperature, top_k, top_p, vocab)
    greedy = temperature == 0
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature)
    # temperature 1 (the API's default) divides by one: skip a pass over [B, V]
    scaled = logits / divisor[:, None] if plan.scale else logits
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if plan.filter:
        width = CANDIDATES if scaled.device.type == "cpu" and vocab > CANDIDATES else vocab
        scaled = top_k_top_p(scaled, k, top_p, width)
    probs = scaled.softmax(-1)
    if plan.greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


# top-k / top-p on the CPU first rank only this many best tokens of each row: a full sort of a
# 262k-token row took 30 ms on 2 cores (more than the model's whole decode step), a top-1024 about 1
CANDIDATES = 1024


def top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, width: int) -> torch.Tensor:
    """`scaled` [B, V] with every token outside each row's top-k and top-p nucleus set to -inf.

    A token is kept when its rank is below k and the probability mass ranked before it is at
    most top_p. Only the `width` best tokens are ranked (`topk`); a row that keeps its last
    ranked token may keep more, so those rows alone are ranked again, 16 times wider or, where
    that provably cannot hold their nucleus, in full (on the CPU, where asking costs nothing;
    elsewhere `width` is the vocabulary).
    """
    vocab = scaled.shape[-1]
    ranked, order = scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True)
    probs = (ranked - scaled.logsumexp(-1, keepdim=True)).exp()
    drop = torch.arange(width, device=scaled.device)[None, :] >= k[:, None]
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]
    out = torch.full_like(scaled, float("-inf")).scatter_(-1, order, ranked.masked_fill(drop, float("-inf")))
    if width < vocab and bool((~drop[:, -1]).any()):
        rows = (~drop[:, -1]).nonzero()[:, 0]
        # every unranked token is at most as likely as the last ranked one: the nucleus needs at
        # least (top_p - ranked mass) / that probability more, so skip a width that cannot hold it
        short = (top_p[rows] - probs[rows].sum(-1)) / probs[rows, -1].clamp_min(1e-30)
        need = torch.minimum(k[rows].double(), width + short.double()).max()
        wider = vocab if float(need) > 16 * width else min(16 * width, vocab)
        out[rows] = top_k_top_p(scaled[rows], k[rows], top_p[rows], wider)
    return out


def uniform_noise(
    shape: tuple[int, ...],
    generators: list[torch.Generator | None],
    default: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """U[0, 1) noise [B, ...] on `device`; rows with their own generator (seeded requests) draw
    from it. Drawn on the host from CPU generators, so a seed means the same numbers anywhere."""
    with device_io.staging():
        noise = torch.rand(shape, generator=default, dtype=dtype)
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row] = torch.rand(shape[1:], generator=gen, dtype=dtype)
        return device_io.to_device(noise, device)


def gumbel_noise(generators: list[torch.Generator | None], default: torch.Generator, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [rows, vocab] on the host, -log(-log(u)) of U[0, 1) draws.

    argmax(logits / T + noise) is then an exact draw from softmax(logits / T) (the Gumbel-max
    trick): the draw is an argmax, which an int8 screen of the head finds exactly. u = 0 gives
    -inf (never drawn), the largest u below 1 about 16.6. Each row draws once, from its request's
    generator or else the default (a 262k-row draw is about 1.3 ms on 2 cores; the logs 1.6)."""
    u = torch.empty(len(generators), vocab)
    for row, gen in enumerate(generators):
        u[row].uniform_(generator=gen if gen is not None else default)
    return u.log_().neg_().log_().neg_()


@dataclass
class GumbelDraw:
    """The perturbation that turns a step's logits rows into scores whose argmax is the token:
    logits / temperature + noise (greedy rows: temperature 1, noise 0). One definition for the
    whole head and the screened one, so both give the same scores, bit for bit, where both compute."""

    temperature: torch.Tensor  # [rows] float32
    noise: torch.Tensor  # [rows, V] float32

    def apply(self, values: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """`values` [rows, V] (or its `columns`) perturbed in place, returned."""
        noise = self.noise if columns is None else self.noise.index_select(1, columns)
        return values.div_(self.temperature[:, None]).add_(noise)


SAMPLE_BLOCK = 4096  # tokens per block of the two-level inverse CDF


def sample(probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows sum to > 0), drawn exactly from each row.

    Inverse CDF in two levels: a block of ``SAMPLE_BLOCK`` tokens from the blocks' masses, then
    the token inside it from that block's float64 cumulative sum. One float64 cumulative sum over
    the whole row would cost ten times a float32 pass; a float32 one would drop the long tail
    (1e-9 added to 0.9 rounds away). The first token whose cumulative mass exceeds the target is
    drawn, so a zero-probability token (whose cumulative sum equals its predecessor's) never is.
    """
    rows, vocab = probs.shape
    u = uniform_noise((rows,), generators, default, dtype=torch.float64, device=probs.device)
    pad = (-vocab) % SAMPLE_BLOCK
    padded = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).float().view(rows, -1, SAMPLE_BLOCK)
    block_cdf = padded.sum(-1).double().cumsum(-1)
    target = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, target[:, None], right=True)[:, 0]
    past = block >= block_cdf.shape[1]
    block = block.clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = padded[torch.arange(rows, device=probs.device), block].cumsum(-1, dtype=torch.float64)
    within = torch.searchsorted(inner, (target - before)[:, None], right=True)[:, 0]
    past |= within >= SAMPLE_BLOCK  # a block's float32 sum and its float64 cumulative sum disagree
    tokens = block * SAMPLE_BLOCK + within.clamp(max=SAMPLE_BLOCK - 1)
    # the target rounded up to a total: the row's last token with mass. Off the CPU always
    # computed (one more pass), as asking whether any row needs it would read a value back
    if probs.device.type != "cpu" or bool(past.any()):
        last = vocab - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        tokens = torch.where(past, last, tokens)
    return tokens


def param_tensors(
    params: list[SamplingParams], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top_k and top_p tensors on `device`."""
    return (
        device_io.tensor([p.temperature for p in params], torch.float32, device),
        device_io.tensor([p.top_k for p in params], torch.long, device),
        device_io.tensor([p.top_p for p in params], torch.float32, device),
    )


def processed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`process_logits` for rows sampled with `params`, on the logits' device, nothing read back."""
    plan = LogitsPlan.of(params, logits.shape[-1])
    return process_logits(logits, *param_tensors(params, logits.device), plan=plan)


def top_logprobs(
    logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
) -> list[dict[int, float] | None]:
    """For rows that asked: the sampled token's logprob and the top-n, from the raw logits."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(params)
    if not wanted:
        return result
    device = logits.device
    logp = logits.index_select(0, device_io.tensor(wanted, torch.long, device)).float().log_softmax(-1)
    n_top = min(max(params[row].logprobs or 0 for row in wanted), logp.shape[-1])
    chosen = logp.gather(1, device_io.tensor([[tokens[row]] for row in wanted], torch.long, device))
    vals, ids = logp.topk(n_top, dim=-1)
    # one read-back for every row: ids are exact in float64
    packed = device_io.to_host(torch.cat([chosen.double(), vals.double(), ids.double()], dim=1))
    for row, line in zip(wanted, packed):
        n = params[row].logprobs or 0
        entry = {tokens[row]: line[0]}
        entry.update({int(i): v for i, v in zip(line[1 + n_top : 1 + n_top + n], line[1 : 1 + n])})
        result[row] = entry
    return result


class Sampler:
    """Samples one token per row; owns the default generator (seeded once per engine)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
        drawn: bool = False,
    ) -> SampleResult:
        """Penalise, process and draw for every row of `logits` [B, V]; `drawn`: the rows are
        already scores whose argmax is the token (greedy rows and Gumbel draws, `GumbelDraw`)."""
        if drawn:
            return SampleResult(tokens=device_io.to_host(argmax_ids(logits)), logprobs=[None] * len(params))
        raw = logits
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits.to(torch.float32, copy=True), params, prompts, outputs)
        if all(p.greedy for p in params):
            tokens = device_io.to_host(argmax_ids(logits))
        else:
            tokens = device_io.to_host(sample(processed(logits, params), generators, self.generator))
        return SampleResult(tokens=tokens, logprobs=top_logprobs(raw, tokens, params))
