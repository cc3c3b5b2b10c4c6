"""RTN, GPTQ and AWQ building blocks against float64 brute-force references."""

from __future__ import annotations

import logging

import pytest
import torch

from quantize.awq import AWQOptions, apply_clip, apply_scale, search_clip, search_scale
from quantize.gptq import GPTQOptions, HessianAccumulator, gptq_quantize
from quantize.quantizer import QuantSpec, quantize_rtn


def brute_rtn(w: torch.Tensor, bits: int, gs: int, sym: bool) -> torch.Tensor:
    """Per group, element by element, float64, following the stated grid rules."""
    maxq = 2**bits - 1
    out = torch.empty_like(w, dtype=torch.float64)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], gs):
            grp = w[r, g0 : g0 + gs].double()
            if sym:
                scale = 2 * max(float(grp.abs().max()), 1e-6) / maxq
                zero = (maxq + 1) // 2
            else:
                lo, hi = min(float(grp.min()), 0.0), max(float(grp.max()), 0.0)
                scale = (hi - lo) / maxq
                zero = round(-lo / scale)
                if zero < 1:
                    scale, zero = hi / (maxq - 1), 1
            scale = float(torch.tensor(scale).half())
            for c in range(gs):
                q = min(max(round(float(grp[c]) / scale) + zero, 0), maxq)
                out[r, g0 + c] = (q - zero) * scale
    return out


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (3, False), (8, True)])
def test_rtn_matches_brute_force(bits: int, sym: bool) -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    w[0, :32] = w[0, :32].abs()  # a group with no negative weight: zero point must stay >= 1
    ql = quantize_rtn(w, QuantSpec(bits, 32, sym))
    assert int(ql.zeros.min()) >= 1 and int(ql.codes.max()) <= 2**bits - 1
    assert torch.equal(ql.scales, ql.scales.half().float())
    torch.testing.assert_close(ql.dequantize().double(), brute_rtn(w, bits, 32, sym), rtol=0, atol=1e-6)


def test_rtn_error_bounded_by_half_step() -> None:
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    ql = quantize_rtn(w, QuantSpec(4, 32, False))
    step = ql.scales[:, ql.g_idx.long()]
    assert bool(((w - ql.dequantize()).abs() <= step / 2 + 1e-6).all())


def test_hessian_accumulator_is_running_mean() -> None:
    xs = [torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    acc = HessianAccumulator(16)
    for x in xs:
        acc.add(x)
    flat = torch.cat([x.reshape(-1, 16) for x in xs]).double()
    torch.testing.assert_close(acc.h.double(), 2 * flat.t() @ flat / flat.shape[0], rtol=1e-5, atol=1e-5)


def _correlated_inputs(n: int = 2048, d: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5
    x = torch.randn(n, d, generator=g) @ mix + 0.1 * torch.randn(n, d, generator=g)
    x[:, :4] *= 10  # outlier channels
    return x


def test_gptq_with_diagonal_hessian_is_rtn() -> None:
    """No correlation between inputs: nothing to compensate, so GPTQ must equal RTN."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    h = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(5)) + 0.5)
    spec = QuantSpec(4, 32, False)
    assert torch.equal(gptq_quantize(w, h, spec, GPTQOptions()).codes, quantize_rtn(w, spec).codes)


@pytest.mark.parametrize("act_order,static", [(False, True), (True, True), (True, False)])
def test_gptq_beats_rtn_on_output_error(act_order: bool, static: bool) -> None:
    x = _correlated_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    acc = HessianAccumulator(128)
    acc.add(x)
    spec = QuantSpec(4, 32, True)
    ql = gptq_quantize(w, acc.h, spec, GPTQOptions(act_order=act_order, static_groups=static))
    err_gptq = (x @ (w - ql.dequantize()).t()).pow(2).mean()
    err_rtn = (x @ (w - quantize_rtn(w, spec).dequantize()).t()).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn
    trivial = torch.arange(128, dtype=torch.int32) // 32
    assert torch.equal(ql.g_idx, trivial) == (not act_order or static)


def test_gptq_lazy_blocks_equal_unblocked() -> None:
    x = _correlated_inputs(seed=1)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    acc = HessianAccumulator(128)
    acc.add(x)
    spec = QuantSpec(4, 32, False)
    blocked = gptq_quantize(w.double().float(), acc.h, spec, GPTQOptions(blocksize=128)).dequantize()
    single = gptq_quantize(w, acc.h, spec, GPTQOptions(blocksize=1)).dequantize()
    assert (blocked == single).float().mean() > 0.99  # float reassociation may flip a rare tie


def test_gptq_retries_cholesky_with_more_damping(caplog: pytest.LogCaptureFixture) -> None:
    h = torch.eye(32)
    h[0, 0] = -0.05  # indefinite: damp 0.01 * mean diag cannot fix it, 0.1 can
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(8))
    with caplog.at_level(logging.WARNING, logger="warsha.quantize"):
        ql = gptq_quantize(w, h, QuantSpec(4, 32, True), GPTQOptions(damp=0.01), name="model.layers.3.mlp.down_proj")
    assert torch.isfinite(ql.dequantize()).all()
    assert "model.layers.3.mlp.down_proj" in caplog.text and "retrying with damp 0.1" in caplog.text


def test_gptq_gives_up_with_a_clear_error() -> None:
    h = -torch.eye(32)
    h[0, 0] = 5.0
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj: the Hessian is not positive definite"):
        gptq_quantize(
            torch.randn(4, 32), h, QuantSpec(4, 32, True), GPTQOptions(), name="model.layers.0.self_attn.q_proj"
        )


def test_awq_scale_folding_preserves_float_output() -> None:
    torch.manual_seed(0)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.rand(32) + 0.5)
    prev = torch.nn.Linear(16, 32)
    fc1, fc2 = torch.nn.Linear(32, 8), torch.nn.Linear(32, 8)
    x = torch.randn(10, 32)
    h = torch.randn(10, 16)
    s = torch.rand(32) + 0.5
    ref_norm = [fc(x * norm.weight) for fc in (fc1, fc2)]
    apply_scale(norm, "norm", [fc1, fc2], s)
    for fc, ref in zip((fc1, fc2), ref_norm):
        torch.testing.assert_close(fc(x * norm.weight), ref, rtol=1e-5, atol=1e-5)
    ref_lin = fc1(prev(h))
    apply_scale(prev, "linear", [fc1], s)
    torch.testing.assert_close(fc1(prev(h)), ref_lin, rtol=1e-5, atol=1e-5)


def test_awq_scale_search_finds_outlier_channels() -> None:
    x = _correlated_inputs(512, 64, seed=2)
    fc = torch.nn.Linear(64, 32, bias=False)
    spec = QuantSpec(4, 32, False)
    original = fc.weight.data.clone()
    s, alpha, rel = search_scale(x, [fc], lambda: fc(x), spec, AWQOptions())
    assert alpha > 0 and rel < 1.0
    assert s[:4].mean() > s[4:].mean()  # the outlier channels get the larger scales
    assert torch.equal(fc.weight.data, original)  # the search leaves the weights as it found them


def test_awq_clip_search_lowers_output_error() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 64, generator=g)
    w[:, 5] *= 8  # a few large weights stretch their groups' grids
    x = torch.randn(300, 64, generator=g)
    spec = QuantSpec(4, 32, False)
    fc = torch.nn.Linear(64, 16, bias=False)
    fc.weight.data = w.clone()
    max_val = search_clip(x, w, spec, AWQOptions())
    assert bool((max_val <= w.reshape(16, 2, 32).abs().amax(-1) + 1e-6).all())
    apply_clip(fc, max_val, 32)
    err_clip = (x @ (w - quantize_rtn(fc.weight.data, spec).dequantize()).t()).pow(2).mean()
    err_rtn = (x @ (w - quantize_rtn(w, spec).dequantize()).t()).pow(2).mean()
    assert err_clip < err_rtn


def test_weight_salience_matches_a_loop() -> None:
    from quantize.awq import weight_salience

    g = torch.Generator().manual_seed(4)
    fcs = [torch.nn.Linear(16, n, bias=False) for n in (3, 5)]
    for fc in fcs:
        fc.weight.data = torch.randn(fc.weight.shape, generator=g, dtype=torch.float32)
    got = weight_salience(fcs, 8)
    rows = [r for fc in fcs for r in fc.weight.data.double().tolist()]
    for c in range(16):
        vals = []
        for r in rows:
            group = r[(c // 8) * 8 : (c // 8) * 8 + 8]
            vals.append(abs(r[c]) / (max(abs(v) for v in group) + 1e-6))
        assert float(got[c]) == pytest.approx(sum(vals) / len(vals), rel=1e-5)


@pytest.mark.parametrize("duo", [False, True])
def test_awq_search_returns_the_best_candidate_of_its_family(duo: bool) -> None:
    from quantize.awq import candidate_scale, weight_salience

    x = _correlated_inputs(256, 64, seed=3)
    fc = torch.nn.Linear(64, 32, bias=False)
    spec = QuantSpec(4, 32, False)
    opts = AWQOptions(duo_scaling=duo)
    s, alpha, _ = search_scale(x, [fc], lambda: fc(x), spec, opts)
    act = x.reshape(-1, 64).abs().float().mean(0)
    w_mean = weight_salience([fc], 32) if duo else None
    assert torch.allclose(s, candidate_scale(act, w_mean, alpha))
    ref = fc(x).detach()
    w = fc.weight.data.clone()

    def err(scale: torch.Tensor) -> float:  # brute force: output MSE with the scaled, rounded weight
        deq = quantize_rtn(w * scale, spec).dequantize() / scale
        return float((x @ deq.t() - ref).pow(2).mean())

    best = min(err(candidate_scale(act, w_mean, k / opts.n_grid)) for k in range(opts.n_grid))
    assert err(s) == pytest.approx(best, rel=1e-5)


def test_awq_bf16_search_runs_the_block_in_bf16_and_keeps_a_near_best_scale() -> None:
    """search_bf16: every rerun of the inspected block (the reference too) is under bf16
    autocast; the alpha it picks scores, in float32, within 2% of the float32 search's best."""
    x = _correlated_inputs(512, 64, seed=2)
    fc = torch.nn.Linear(64, 32, bias=False)
    spec = QuantSpec(4, 32, False)
    seen: list[torch.dtype] = []

    def inspect() -> torch.Tensor:
        out = fc(x)
        seen.append(out.dtype)
        return out

    s16, _, _ = search_scale(x, [fc], inspect, spec, AWQOptions(search_bf16=True))
    assert seen and set(seen) == {torch.bfloat16}
    s32, _, _ = search_scale(x, [fc], lambda: fc(x), spec, AWQOptions())
    ref, w = fc(x).detach(), fc.weight.data.clone()

    def err(scale: torch.Tensor) -> float:
        return float((x @ (quantize_rtn(w * scale, spec).dequantize() / scale).t() - ref).pow(2).mean())

    assert err(s16) <= err(s32) * 1.02
