"""The exact argmax of a large LM head from an int8 copy: read half the head's bytes, change no token.

Why: on a model with a large vocabulary the head is most of what a decode step reads (Gemma 3
270M in bf16: 335 of 539 MB). A greedy step only needs the argmax of the logits, and an int8
copy of the head (one scale per row, `serve.head_quant`) bounds every logit: with w = s q + e,
|e| <= s / 2 elementwise, the exact logit of row r lies within

    b_r = s_r * (||x||_1 / 2 + ||q_r||_1 * eps_x)

of the int8 one, where eps_x covers how the int8 kernel reads x (rounded to int16 on the VNNI
variants: half a step of max|x| / 32767; float32 sums elsewhere) plus float32 rounding. Every
row whose upper bound reaches the best lower bound is a candidate; the head's own kernel then
computes the candidates exactly, on the same bf16 (or float32) rows and with the same per-row
sums as the whole head would, and writes them over the int8 values. A row left out lies more
than a bf16 rounding step below the best exact logit, so the argmax (first index on ties) is
the whole head's, bit for bit. On Gemma 3's head a step has 1-300 candidates of 262,144.

Only argmax consumers may read the result: greedy requests without penalties or logprobs
(`SamplingParams.argmax_only`), and plain sampled ones (`SamplingParams.gumbel_sampled`: no
top-k, top-p, penalties or logprobs), which the CPU engine draws as argmax(logits / T + G) with
Gumbel noise G (`serve.sampler.GumbelDraw`): the bounds then scale by 1 / T and the noise moves
every bound alike, so the same rows decide. Everything else takes the whole head. The copy costs half the
head's bf16 bytes in memory (a quarter of float32's).
"""

from __future__ import annotations

import torch

from serve import cpu_kernels, hugepages
from serve.head_quant import quantize_rows_int8
from serve.head_screen_batch import BatchScreen
from serve.head_screen_batch import applies as batch_applies
from serve.sampler import GumbelDraw

MIN_ROWS = 16384  # smaller heads are a small share of a step; the bookkeeping would not pay
FLAT_SHARE = 4  # more than 1 / FLAT_SHARE of the rows as candidates: compute the whole head
BF16_STEP = 2.0**-7  # a bf16 rounding moves a value by at most half of this, relatively


class HeadScreen:
    """An int8 copy of a CPU head that finds the rows the argmax can be in, then computes them exactly."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"HeadScreen takes a bf16 or float32 CPU weight, got {weight.dtype} on {weight.device}")
        self.weight = weight  # the head itself: the candidates' exact rows
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows_int8(weight)
        self.q, self.scale = hugepages.place(q), hugepages.place(scale)
        self.scale_l1 = scale * q.abs().sum(dim=1, dtype=torch.int32).float()  # s_r ||q_r||_1
        self.scale_max, self.scale_l1_max = float(scale.max()), float(self.scale_l1.max())
        self.calls, self.candidates = 0, 0  # screened rows of x, and rows computed exactly for them
        self.flat = 0  # rows of x for which so many rows could win that the whole head ran instead
        # batches past the one-row kernel's rows: the packed uint8 screen where it runs
        self.batch = BatchScreen(weight, self.q, self.scale, self.scale_l1) if batch_applies(weight) else None

    def screened(
        self, x: torch.Tensor, draw: GumbelDraw | None, small_rows: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`logits` for decode-sized x (up to `small_rows` rows); for larger argmax-only batches
        without sampled rows, the batch screen's argmax of each row, int64 [rows] (`out` its
        scratch when given: `BatchScreen.argmax`); None where neither applies (the batch screen
        still calibrating, a flat distribution): then the whole head."""
        rows = x.shape[0]
        if self.batch is not None:
            self.batch.observe(x)
        if 0 < rows <= small_rows:
            return self.logits(x, draw)
        if self.batch is None or not self.batch.ready or draw is not None:
            return None
        got, found = self.batch.argmax(x, self.bounds, BF16_STEP, 1e-6, out)
        self.calls += rows
        if got is None:
            self.flat += rows
            return None
        self.candidates += found
        return got

    def bounds(self, x: torch.Tensor, rounding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of x [rows, K]: a and c of the bound b_r = a * s_r + c * s_r ||q_r||_1.

        Rounding: `rounding` [rows] bounds how far the int8 kernel moves each element of x (the
        batch screen's uint8 / int16 steps, halved); by default the one-row kernel's: x rounded
        to int16 on the VNNI variants (half a step of max|x| / 32767), else none. Both kernels sum K
        float32 products, each sum within K 2^-24 of sum |w x| <= s_r (||q_r||_1 + K / 2) max|x|;
        both are taken four times over. The float32 roundings of the finished sums are within
        the floor's bf16 margin."""
        x32 = x.float()
        top = x32.abs().amax(dim=1)
        k = self.in_features
        slack = 1.0 + 2.0**-10  # float32 rounding of the bound itself and of the scales
        a = (x32.abs().sum(dim=1) * 0.5 + top * (k * k * 2.0**-23)) * slack
        eps_x = top * (k * 2.0**-22)
        if rounding is not None:
            eps_x = eps_x + rounding
        elif cpu_kernels.int8_rounds_activations(k):  # the running variant rounds x to int16
            eps_x = eps_x + top / 32767.0 * 0.5
        return a.contiguous(), (eps_x * slack).contiguous()

    def logits(self, x: torch.Tensor, draw: GumbelDraw | None = None) -> torch.Tensor:
        """float32 [rows, V]: the head's exact logits at every candidate row, the int8 ones elsewhere,
        each perturbed by `draw` when given (sampled rows: logits / T + Gumbel noise).

        Their argmax equals the whole head's (perturbed the same way) for each row of x (bf16 or
        float32, decode-sized).
        """
        out = cpu_kernels.gemv_int8(x, self.q, self.scale, torch.float32)
        a, c = self.bounds(x)
        slack = 1e-6
        if draw is not None:  # bounds scale by 1 / T; a bf16 rounding of a logit moves a score by
            # up to 2^-8 |logit| / T, relative to the logit, not to the perturbed score
            t = draw.temperature
            top = float(out.abs().amax()) + float(a.max()) * self.scale_max + float(c.max()) * self.scale_l1_max
            slack += 2.0 * 2.0**-8 * top / float(t.min())
            draw.apply(out)
            a, c = a / t, c / t
        ids = cpu_kernels.screen_candidates(out, self.scale, self.scale_l1, a, c, BF16_STEP, slack)
        self.calls, self.candidates = self.calls + x.shape[0], self.candidates + ids.numel()
        if ids.numel() * FLAT_SHARE > self.out_features:  # gathering them would cost more than the head
            self.flat += x.shape[0]
            whole = self.exact(x, self.weight)
            return whole if draw is None else draw.apply(whole)
        exact = self.exact(x, self.weight.index_select(0, ids))
        out.index_copy_(1, ids, exact if draw is None else draw.apply(exact, ids))
        return out

    @property
    def pays(self) -> bool:
        """False once most rows of x found a flat distribution (an untrained model, say): then the
        int8 pass is pure cost and the model stops asking."""
        return self.calls < 32 or self.flat * 2 < self.calls

    @staticmethod
    def exact(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The head's decode-row kernel on some of its rows: the numbers the whole head gives there."""
        if x.dtype == torch.bfloat16:
            return cpu_kernels.gemv_bf16(x, rows, torch.bfloat16).float()
        return cpu_kernels.gemv_f32(x, rows, torch.float32)
