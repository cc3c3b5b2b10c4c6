"""AWQ (Lin et al., 2023): protect the weights that meet large activations.

For each scaling group of a decoder layer (arch.py: a norm or linear feeding some linears), a
per-input-channel scale ``s = mean|x|^alpha`` (optionally divided by the fed weights' in-group
salience to the power ``1 - alpha``: duo scaling), normalised to geometric mean 1, is divided out of
the feeder and multiplied into the fed linears, which leaves the float model unchanged but lets
salient channels use more of the integer grid. ``alpha`` is chosen on a grid of 20 values in
[0, 1) by the MSE of the inspected block's output with the fed linears fake-quantized. Then each
linear's per-group clipping threshold is searched (shrinking the max by up to 50%) against the
linear's own output error, and the scaled, clipped weights are rounded to nearest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantize.arch import ArchSpec, ScaleGroup, get_module
from quantize.quantizer import QuantizedLinear, QuantSpec, find_params, quantize_codes, quantize_rtn

log = logging.getLogger("warsha.quantize")


@dataclass
class AWQOptions:
    """Search grids, and the precision of the scale search's block reruns.

    ``search_bf16``: the inspected block (attention or MLP, rerun once per alpha on every
    calibration token: 82% of the stage on a 2-core CPU) runs under bf16 autocast, the reference
    output too, so every alpha is judged in the same arithmetic; the weights, their scaling and
    rounding, and the clip search stay in the compute dtype.
    """

    n_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    clip: bool = True
    duo_scaling: bool = False
    search_bf16: bool = False


def _fake_quant(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return quantize_rtn(w, spec).dequantize()


def search_scale(
    x: torch.Tensor,
    linears: list[torch.nn.Linear],
    inspect: Callable[[], torch.Tensor],
    spec: QuantSpec,
    opts: AWQOptions,
) -> tuple[torch.Tensor, float, float]:
    """Best per-channel scale for ``linears`` fed by inputs ``x[..., in]``.

    ``inspect()`` reruns the inspected block on the captured inputs with whatever weights the
    linears hold at the time. Returns (scales, best alpha, best loss relative to alpha = 0).
    """
    act = x.reshape(-1, x.shape[-1]).abs().float().mean(0)
    w_mean = weight_salience(linears, spec.group_size) if opts.duo_scaling else None
    device = linears[0].weight.device.type
    # no cast cache: the linears get new weights for every alpha, the cache would keep the first
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=opts.search_bf16, cache_enabled=False):
        reference = inspect().float()
        originals = [fc.weight.data.clone() for fc in linears]
        best = (float("inf"), 0.0, torch.ones_like(act))
        first_loss = None
        for k in range(opts.n_grid):
            alpha = k / opts.n_grid
            s = candidate_scale(act, w_mean, alpha)
            for fc, w in zip(linears, originals):
                fc.weight.data = (_fake_quant(w.float() * s, spec) / s).to(w.dtype)
            loss = float((inspect().float() - reference).pow(2).mean())
            first_loss = loss if first_loss is None else first_loss
            if loss < best[0]:
                best = (loss, alpha, s.clone())
        for fc, w in zip(linears, originals):
            fc.weight.data = w
    return best[2], best[1], best[0] / max(first_loss or 1.0, 1e-30)


def weight_salience(linears: list[torch.nn.Linear], group_size: int) -> torch.Tensor:
    """Mean over the fed linears' rows of |w| relative to its group's max, per input channel.

    Why: a channel whose weights are already small within their groups loses the most to
    rounding; dividing the activation statistic by this ("duo" scaling, as llm-compressor's
    AWQ does by default) lets one grid trade activation and weight salience.
    """
    w = torch.cat([fc.weight.detach().float() for fc in linears], dim=0)
    rows, cols = w.shape
    g = group_size if group_size > 0 and cols % group_size == 0 else cols
    grouped = w.abs().reshape(rows, cols // g, g)
    rel = grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)
    return rel.reshape(rows, cols).mean(0)


def candidate_scale(act: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """``act^a`` (or ``act^a / w_mean^(1-a)`` with duo scaling), normalised to geometric-ish mean 1."""
    s = act.pow(alpha) if w_mean is None else act.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def apply_scale(prev: torch.nn.Module, prev_kind: str, linears: list[torch.nn.Linear], s: torch.Tensor) -> None:
    """Fold ``s`` into the feeder (divide) and the fed linears (multiply): float output unchanged."""
    with torch.no_grad():
        if prev_kind == "norm":
            prev.weight.data = (prev.weight.float() / s).to(prev.weight.dtype)
        elif prev_kind == "norm_plus_one":  # Gemma: the norm multiplies by (1 + w)
            prev.weight.data = ((1.0 + prev.weight.float()) / s - 1.0).to(prev.weight.dtype)
        else:
            prev.weight.data = (prev.weight.float() / s[:, None]).to(prev.weight.dtype)
            if getattr(prev, "bias", None) is not None:
                prev.bias.data = (prev.bias.float() / s).to(prev.bias.dtype)
        for fc in linears:
            fc.weight.data = (fc.weight.float() * s[None, :]).to(fc.weight.dtype)


def search_clip(x: torch.Tensor, weight: torch.Tensor, spec: QuantSpec, opts: AWQOptions) -> torch.Tensor:
    """Per (output row, group) clipping threshold minimising the group's output error."""
    x = x.reshape(-1, x.shape[-1]).float()
    step = max(1, x.shape[0] // opts.clip_tokens)
    x = x[::step][: opts.clip_tokens]
    out_f, in_f = weight.shape
    gs = spec.group_size
    ng = in_f // gs
    xg = x.reshape(x.shape[0], ng, gs)
    chunk = max(1, int(2**24 // max(x.shape[0] * ng, 1)))
    best_all = []
    for r0 in range(0, out_f, chunk):
        w = weight[r0 : r0 + chunk].float().reshape(-1, ng, gs)
        ref = torch.einsum("tgk,ogk->otg", xg, w)
        org_max = w.abs().amax(dim=-1, keepdim=True)
        best_err = torch.full((w.shape[0], ng), float("inf"), device=w.device)
        best_max = org_max.clone()
        for k in range(int(opts.max_shrink * opts.n_grid)):
            max_val = org_max * (1 - k / opts.n_grid)
            cur = torch.clamp(w, -max_val, max_val).reshape(-1, gs)
            scale, zero = find_params(cur, spec)
            deq = ((quantize_codes(cur, scale, zero, spec.maxq) - zero[:, None]) * scale[:, None]).reshape(w.shape)
            err = (torch.einsum("tgk,ogk->otg", xg, deq) - ref).pow(2).mean(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[:, :, None], max_val, best_max)
        best_all.append(best_max.reshape(-1, ng))
    return torch.cat(best_all)


def apply_clip(linear: torch.nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    """Clamp each weight group to ``[-max, max]``."""
    with torch.no_grad():
        out_f, in_f = linear.weight.shape
        w = linear.weight.float().reshape(out_f, in_f // group_size, group_size)
        m = max_val[:, :, None]
        linear.weight.data = torch.clamp(w, -m, m).reshape(out_f, in_f).to(linear.weight.dtype)


def _group_active(layer: Any, group: ScaleGroup) -> bool:
    if not group.needs_same_width:
        return True
    prev = get_module(layer, group.prev)
    return all(get_module(layer, n).in_features == prev.out_features for n in group.linears)


def awq_layer(
    layer: Any,
    arch: ArchSpec,
    spec: QuantSpec,
    opts: AWQOptions,
    captured: dict[str, list[torch.Tensor]],
    run_attention: Callable[[torch.Tensor, int], torch.Tensor],
    quantize_names: list[str],
    prefix: str,
) -> tuple[dict[str, QuantizedLinear], dict[str, float]]:
    """Scale search, scale folding, clip search and rounding for one decoder layer.

    ``captured[name]`` holds the per-batch inputs of the first linear of each sequential step
    (so of every linear); ``run_attention(x, batch)`` reruns the attention block on batch
    ``batch`` with captured keyword arguments. Returns the quantized linears and the alphas.
    """
    step_of = _step_of(arch)
    inputs = {k: list(v) for k, v in captured.items()}
    alphas: dict[str, float] = {}
    for group in arch.scale_groups:
        if not _group_active(layer, group):
            continue
        names = [n for n in group.linears if n in quantize_names]
        if not names:
            continue
        key = step_of[group.linears[0]]
        xs = inputs[key]
        fcs = [get_module(layer, n) for n in group.linears]
        inspect = _inspector(layer, group, arch, xs, run_attention)
        flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])
        s, alpha, rel = search_scale(flat, [get_module(layer, n) for n in names], inspect, spec, opts)
        apply_scale(get_module(layer, group.prev), group.prev_kind, fcs, s)
        inputs[key] = [x / s.to(x.dtype) for x in xs]  # the fed linears' inputs shrink by s
        alphas[f"{prefix}.{group.prev}"] = alpha
        log.debug("awq %s.%s: alpha %.2f, loss %.3f of alpha=0", prefix, group.prev, alpha, rel)
    out: dict[str, QuantizedLinear] = {}
    for name in quantize_names:
        fc = get_module(layer, name)
        if opts.clip and name not in arch.no_clip:
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[step_of[name]]])
            apply_clip(fc, search_clip(x, fc.weight.data, spec, opts), spec.group_size)
        ql = quantize_rtn(fc.weight.data, spec, fc.bias.data if fc.bias is not None else None)
        fc.weight.data = ql.dequantize().to(fc.weight.dtype)
        out[name] = ql
    return out, alphas


def _step_of(arch: ArchSpec) -> dict[str, str]:
    """Every linear of a sequential step shares the input captured at the step's first linear."""
    return {name: step[0] for step in arch.sequential for name in step}


def _inspector(
    layer: Any,
    group: ScaleGroup,
    arch: ArchSpec,
    xs: list[torch.Tensor],
    run_attention: Callable[[torch.Tensor, int], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    """A closure that reruns the group's inspected block on the captured inputs."""
    if group.inspect == arch.attention:
        return lambda: torch.cat([run_attention(x, b).flatten(0, -2) for b, x in enumerate(xs)])
    module = get_module(layer, group.inspect)
    return lambda: torch.cat([module(x).flatten(0, -2) for x in xs])
