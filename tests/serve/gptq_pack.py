"""Independent GPTQ v1 packing for tests: brute-force loops, written from the format description."""

from __future__ import annotations

import torch


def _to_int32(values: list[list[int]]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


def quantize_to_gptq(w: torch.Tensor, group_size: int, act_order: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """w [N, K] -> qweight, qzeros, scales, g_idx in the GPTQ v1 checkpoint layout."""
    n_out, k_in = w.shape
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(k_in, generator=g) if act_order else torch.arange(k_in)
    g_idx = torch.empty(k_in, dtype=torch.int32)
    for rank, feature in enumerate(order.tolist()):
        g_idx[feature] = rank // group_size
    n_groups = k_in // group_size
    scales = torch.empty(n_groups, n_out)
    zeros = torch.empty(n_groups, n_out, dtype=torch.int64)
    q = torch.empty(k_in, n_out, dtype=torch.int64)
    for grp in range(n_groups):
        members = (g_idx == grp).nonzero().flatten()
        block = w[:, members].T  # [members, N]
        lo, hi = block.min(0).values.clamp(max=0), block.max(0).values.clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = torch.round(-lo / scale).clamp(1, 15).long()
        scales[grp], zeros[grp] = scale, zero
        q[members] = torch.clamp(torch.round(block / scale) + zero, 0, 15).long()
    qweight = [[0] * n_out for _ in range(k_in // 8)]
    for i in range(k_in):
        for o in range(n_out):
            qweight[i // 8][o] |= int(q[i, o]) << (4 * (i % 8))
    qzeros = [[0] * (n_out // 8) for _ in range(n_groups)]
    for grp in range(n_groups):
        for o in range(n_out):
            qzeros[grp][o // 8] |= (int(zeros[grp, o]) - 1) << (4 * (o % 8))
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scales.half(), "g_idx": g_idx}


def brute_force_dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """w[o, i] = scales[g_idx[i], o] * (q[i, o] - (z[g_idx[i], o] + 1)), element by element."""
    qweight = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    k_in, n_out = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(n_out, k_in)
    for i in range(k_in):
        grp = int(t["g_idx"][i])
        row = (qweight[i // 8] >> (4 * (i % 8))) & 0xF
        z = torch.stack([(qzeros[grp, o // 8] >> (4 * (o % 8))) & 0xF for o in range(n_out)])
        w[:, i] = t["scales"][grp].float() * (row - (z + 1)).float()
    return w
