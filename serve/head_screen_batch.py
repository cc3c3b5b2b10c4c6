"""The int8 screen of a large LM head for batches of rows: the exact argmax at twice bf16's product rate.

Why: in a mixed step (24-64 logits rows) the head is bound by arithmetic, not by reading it:
Gemma 3 270M's 262k-row head took 37 of 129 ms a step on a 2-core Zen 4 through oneDNN's bf16
GEMM, near the 32 products per instruction of vdpbf16ps. `serve.head_screen` finds the argmax
of 1-8 rows from an int8 copy of the head but multiplies in int16 (vpdpwssd: 32 products an
instruction too). Here the activations are rounded to uint8 as well, and vpdpbusd takes 64
(csrc/screen_gemm.cpp). The bound keeps `HeadScreen`'s form, b_r = s_r (||x||_1 / 2 + eps_x
||q_r||_1), with eps_x the activations' rounding: half of max(t, t2) (uint8 step t of the main
channels, int16 step t2 of the tail) plus the float32 terms `HeadScreen.bounds` adds.

Tail channels: Gemma 3's final hidden states carry a few channels twenty times the typical size
(median max|x| 69 against a median |x| of 3); one uint8 step for the whole row would be set by
them, and 95k of 262k rows would pass the screen. The `TAIL` channels with the largest mean |x|
over the first `CALIBRATION_ROWS` rows the head reads stay int16 (median 69-101 candidates a row
on real hidden states); until then batches take the whole head. The choice moves only the speed:
the bound holds for any choice, so every row keeps its token.

Candidates are each row's own (not the union over rows). A bf16 head computes them with
`gemv_bf16_pairs`, the decode kernel's arithmetic, so a row's greedy token through this screen is
the one a decode batch of 1-8 rows finds for it; it runs on the avx512_bf16 variant,
and on amx with AMX-INT8, whose tiles take the uint8 x int8 sums (`TDPBUSD`, 1024 products an
instruction; the tail as its low and high bytes). A float32 head (on every VNNI variant,
where oneDNN's float32 GEMM takes 16 products an instruction) computes them with float32 sums in
a fixed order (`gemv_f32_pairs`). Argmax-only batches without sampled rows only, and the
screen hands over each row's argmax (int64 [rows]), not logits: the int8 logits are stored only
in 16-column blocks that can reach a row's floor (`screen_gemm_u8(..., floor=...)`), so no
[rows, V] array is written or scanned. Memory: a second int8 copy in the packed layout (half a
bf16 head, a quarter of a float32 one), its huge pages faulted in when the model loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from serve import cpu_kernels, hugepages

log = logging.getLogger("serve.head_screen")

TAIL = 32  # input channels kept int16 (fewer for narrow heads: `tail_width`)
CALIBRATION_ROWS = 256  # head rows whose mean |x| per channel picks the tail
LANES = 16  # output columns per block of the packed layout
GROUP = 32  # output columns per tile: the packed rows are padded to a multiple of it
FLAT_SHARE = 4  # a row with more than 1 / FLAT_SHARE of the rows as candidates: the whole head instead
# (x, per-row activation rounding) -> (a, c) of the bound a * s_r + c * s_r ||q_r||_1 (`HeadScreen.bounds`)
BoundsFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def tail_width(features: int) -> int:
    """Channels kept int16 for a head with this many input features: `TAIL`, or an eighth of
    narrow ones (even: the int16 pairs of vpdpwssd)."""
    return min(TAIL, features // 8 // 2 * 2)


def applies(weight: torch.Tensor) -> bool:
    """Whether a CPU head runs through this screen on the running kernel variant: bf16 on
    `avx512_bf16` and on amx with AMX-INT8 (its sums on tiles), float32 on every VNNI variant."""
    if weight.device.type != "cpu":
        return False
    isa = cpu_kernels.isa()
    if weight.dtype == torch.bfloat16:
        return isa == "avx512_bf16" or cpu_kernels.screen_on_amx()
    return weight.dtype == torch.float32 and isa in ("avx512_vnni", "avx512_bf16", "amx")


def _tail_quads(wide: torch.Tensor, vp: int) -> torch.Tensor:
    """The tail weights [vp, T] (int8 values) as AMX reads them: per block of 16 rows, quads of 4
    channels with byte 4 * lane + i = channel 4 j + i of row lane (zero channels up to whole
    quads), then one spare KiB (a tile loads 16 quads; those past a block's meet zero activations)."""
    quads = -(-wide.shape[1] // 4)
    q = torch.zeros(vp, quads * 4, dtype=torch.int8)
    q[:, : wide.shape[1]] = wide.to(torch.int8)
    q = q.view(vp // LANES, LANES, quads, 4).transpose(1, 2).reshape(-1)
    return torch.cat([q, torch.zeros(1024, dtype=torch.int8)])


class BatchScreen:
    """The packed uint8 x int8 screen of a head for many rows, calibrated on the rows it first sees."""

    def __init__(self, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_l1: torch.Tensor) -> None:
        self.weight, self.q = weight, q
        self.out_features, self.in_features = q.shape
        self.tail = tail_width(self.in_features)
        pad = cpu_kernels.SCREEN_AMX_K if cpu_kernels.screen_on_amx() else 4  # AMX tile rows, else quads
        self.main = (self.in_features - self.tail + pad - 1) // pad * pad  # uint8 channels, zero-weight padding
        self._row_scales = (scale, scale_l1)
        self.seen = 0
        self.calls = 0  # rows this screen found the argmax of
        self.sums = torch.zeros(self.in_features, dtype=torch.float64)
        self.perm: torch.Tensor | None = None  # input channels, main then tail; None until calibrated
        self.packed: tuple[torch.Tensor, ...] = ()  # main, tail, rowsum (csrc/screen_gemm.cpp)
        # the packed head's huge pages, faulted in now: at the first batch, inside a request's
        # step, it took 0.26 s for Gemma 3's 168 MB (the packing itself 0.09 s)
        vp = -(-self.out_features // GROUP) * GROUP
        self._main = hugepages.zeros((vp // LANES, self.main * LANES), torch.int8)
        self.scales: tuple[torch.Tensor, ...] = ()  # scale and scale_l1, padded to the packed rows

    @property
    def ready(self) -> bool:
        """True once the tail is chosen and the head packed."""
        return self.perm is not None

    def observe(self, x: torch.Tensor) -> None:
        """Count rows of the head's input toward the calibration; pack the head once enough came."""
        if self.ready:
            return
        self.sums += x.float().abs().sum(dim=0, dtype=torch.float64)
        self.seen += x.shape[0]
        if self.seen >= CALIBRATION_ROWS:
            self._pack()

    def _pack(self) -> None:
        """The packed layouts of csrc/screen_gemm.cpp, the tail the widest channels on average
        (`cpu_kernels.screen_pack`: one pass over the int8 copy, 0.09 s for Gemma 3's head)."""
        k, t, v = self.in_features, self.tail, self.out_features
        tail = self.sums.topk(t).indices.sort().values
        keep = torch.ones(k, dtype=torch.bool)
        keep[tail] = False
        perm = torch.cat([keep.nonzero()[:, 0], tail])
        vp = self._main.shape[0] * LANES
        wide, rowsum = torch.empty(vp, t, dtype=torch.int16), torch.empty(vp, dtype=torch.int32)
        cpu_kernels.screen_pack(self.q, perm, self._main, wide, rowsum)
        tail8 = _tail_quads(wide, vp) if cpu_kernels.screen_on_amx() else torch.empty(0, dtype=torch.int8)
        wide = wide.view(vp // LANES, LANES, t // 2, 2).transpose(1, 2).reshape(vp // LANES, -1).contiguous()
        self.packed = (self._main, wide, rowsum, tail8)
        scale, scale_l1 = (torch.nn.functional.pad(s, (0, vp - v)).contiguous() for s in self._row_scales)
        self.scales = (scale, scale_l1)
        self.perm = perm
        log.info("head screen: batches through uint8 x int8 (%d of %d channels int16, from %d rows)", t, k, self.seen)

    def candidates(
        self, x: torch.Tensor, bounds: BoundsFn, step: float, slack: float, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Each row's candidates and their exact logits: (rows, cols, values), cols ascending within
        a row; None where some row has so many (a flat distribution) that the whole head is
        cheaper, or x is not finite. `out` [rows, V] is scratch: the int8 logits go there only in
        tiles that can hold a candidate (sparse stores: no [rows, V] write, nor a scan of one,
        for the sampler)."""
        assert self.perm is not None, "BatchScreen.candidates before calibration"
        rows = x.shape[0]
        quantized = cpu_kernels.screen_quantize(x.float().index_select(1, self.perm), self.main, self.tail)
        params = quantized[2]
        a, c = bounds(x, torch.maximum(params[:, 0], params[:, 1]) * 0.5)
        if not bool(torch.isfinite(a).all()):  # inf or NaN activations: the whole head says what they give
            return None
        out = torch.empty(rows, self.out_features) if out is None else out
        lohi, tile_hi, written = cpu_kernels.screen_gemm_u8(
            quantized, self.packed, self.scales, a, c, out, floor=(step, slack)
        )
        cap = self.out_features // FLAT_SHARE
        r, cols, counts = cpu_kernels.screen_pairs(out, self.scales, a, c, lohi, tile_hi, step, slack, cap, written)
        if bool((counts < 0).any()):
            return None
        pairs = cpu_kernels.gemv_bf16_pairs if self.weight.dtype == torch.bfloat16 else cpu_kernels.gemv_f32_pairs
        return r, cols, pairs(x.contiguous(), self.weight, r, cols)

    def argmax(
        self, x: torch.Tensor, bounds: BoundsFn, step: float, slack: float, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """int64 [rows]: each row's argmax over the whole head (its first maximum, as
        `torch.argmax`), and the candidates found; (None, -1) where `candidates` gives none or an
        exact value is NaN (the whole head then says which index wins)."""
        found = self.candidates(x, bounds, step, slack, out)
        if found is None:
            return None, -1
        r, cols, exact = found
        rows = x.shape[0]
        best = torch.full((rows,), float("-inf")).scatter_reduce_(0, r, exact, "amax")
        top = exact == best[r]  # a NaN equals nothing: its row keeps the sentinel
        ids = torch.full((rows,), self.out_features, dtype=torch.long).scatter_reduce_(0, r[top], cols[top], "amin")
        if bool((ids == self.out_features).any()):
            return None, -1
        self.calls += rows
        return ids, cols.numel()
