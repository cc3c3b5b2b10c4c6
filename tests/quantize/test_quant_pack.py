"""Packing against brute-force loops written from the published layouts (FORMAT.md), and the
dequant reference against the quantizer's own float weights."""

from __future__ import annotations

import pytest
import torch

from quantize import dequant
from quantize.pack import pack_awq, pack_bitstream, pack_gptq, unpack_bitstream
from quantize.quantizer import QuantSpec, quantize_rtn


def _as_u32(x: int) -> int:
    return x & 0xFFFFFFFF


def brute_gptq_column(values: list[int], bits: int) -> list[int]:
    """Bit by bit: value j's bit t goes to stream bit j*bits+t, word (j*bits+t)//32."""
    words = [0] * (len(values) * bits // 32)
    for j, v in enumerate(values):
        for t in range(bits):
            if (v >> t) & 1:
                pos = j * bits + t
                words[pos // 32] |= 1 << (pos % 32)
    return words


def brute_awq_row(values: list[int]) -> list[int]:
    """AutoAWQ's loop: nibble i of word c holds column 8c + [0,2,4,6,1,3,5,7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = []
    for c in range(len(values) // 8):
        w = 0
        for i in range(8):
            w |= values[8 * c + order[i]] << (4 * i)
        words.append(w)
    return words


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_bitstream_matches_brute_force_and_round_trips(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (64, 5), generator=g)
    packed = pack_bitstream(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 5)
    for col in range(5):
        expect = brute_gptq_column(values[:, col].tolist(), bits)
        assert [_as_u32(int(x)) for x in packed[:, col]] == expect
    assert torch.equal(unpack_bitstream(packed, bits, 64), values)


def test_three_bit_matches_autogptq_word_layout() -> None:
    """AutoGPTQ's 3-bit scheme: values 0-9 in word 0 bits 0..29, value 10 split 2+1 bits."""
    values = torch.arange(32) % 8
    words = [_as_u32(int(x)) for x in pack_bitstream(values[:, None], 3)[:, 0]]
    w0 = sum(int(values[j]) << (3 * j) for j in range(10)) | ((int(values[10]) << 30) & 0xFFFFFFFF)
    assert words[0] == w0
    assert words[1] & 1 == (int(values[10]) >> 2) & 1
    assert (words[1] >> 1) & 0x7 == int(values[11])


def _random_ql(bits: int, sym: bool, out_f: int = 24, in_f: int = 64, gs: int = 32):
    g = torch.Generator().manual_seed(bits * 10 + sym)
    return quantize_rtn(
        torch.randn(out_f, in_f, generator=g), QuantSpec(bits, gs, sym), torch.randn(out_f, generator=g)
    )


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (3, False), (8, True)])
def test_gptq_tensors_match_brute_force(bits: int, sym: bool) -> None:
    ql = _random_ql(bits, sym, out_f=32 if bits == 3 else 24)
    t = pack_gptq(ql)
    out_f, in_f = ql.codes.shape
    assert t["qweight"].shape == (in_f * bits // 32, out_f)
    assert t["qzeros"].shape == (in_f // 32, out_f * bits // 32)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (in_f // 32, out_f)
    assert torch.equal(t["g_idx"], torch.arange(in_f, dtype=torch.int32) // 32)
    for n in range(out_f):
        assert [_as_u32(int(x)) for x in t["qweight"][:, n]] == brute_gptq_column(ql.codes[n].tolist(), bits)
    for g in range(in_f // 32):
        stored = [int(z) - 1 for z in ql.zeros[:, g]]
        assert [_as_u32(int(x)) for x in t["qzeros"][g]] == brute_gptq_column(stored, bits)
    if sym and bits == 4:
        assert all(_as_u32(int(x)) == 0x77777777 for x in t["qzeros"].flatten())


def test_awq_tensors_match_brute_force() -> None:
    ql = _random_ql(4, False)
    t = pack_awq(ql)
    in_f = ql.codes.shape[1]
    assert t["qweight"].shape == (in_f, 3) and t["qzeros"].shape == (2, 3)
    for i in range(in_f):
        assert [_as_u32(int(x)) for x in t["qweight"][i]] == brute_awq_row(ql.codes[:, i].tolist())
    for g in range(2):
        assert [_as_u32(int(x)) for x in t["qzeros"][g]] == brute_awq_row(ql.zeros[:, g].tolist())


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (3, True), (8, False)])
def test_dequant_reference_inverts_gptq_packing(bits: int, sym: bool) -> None:
    ql = _random_ql(bits, sym, out_f=32)
    t = pack_gptq(ql)
    w = dequant.gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    assert torch.equal(w, ql.dequantize())


def test_dequant_reference_inverts_awq_packing() -> None:
    ql = _random_ql(4, False)
    t = pack_awq(ql)
    assert torch.equal(dequant.awq_weight(t["qweight"], t["qzeros"], t["scales"], 32), ql.dequantize())


def test_dequant_uses_g_idx_for_permuted_groups() -> None:
    ql = _random_ql(4, False)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    ql.g_idx = (perm // 32).to(torch.int32)  # an act-order style group map
    t = pack_gptq(ql)
    w = dequant.gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4)
    assert torch.equal(w, ql.dequantize())
    with pytest.raises(ValueError, match="g_idx"):
        pack_awq(ql)


def test_awq_rejects_other_bit_widths() -> None:
    with pytest.raises(ValueError, match="4-bit"):
        pack_awq(_random_ql(8, False))


def test_quantization_config_carries_the_keys_loaders_read() -> None:
    from quantize.export import quantization_config

    gptq = quantization_config("gptq", 4, 128, True, [], {"desc_act": True, "static_groups": True})
    assert {k: gptq[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,  # act-order with static groups: g_idx is i // 128, a sequential checkpoint
        "sym": True,
        "checkpoint_format": "gptq",
    }
    assert gptq["static_groups"] is True
    permuted = quantization_config("gptq", 4, 128, True, [], {"desc_act": True, "static_groups": False})
    assert permuted["desc_act"] is True
    assert "dynamic" not in gptq and gptq["modules_to_not_convert"] is None
    awq = quantization_config("awq", 4, 64, False, ["model.layers.0.mlp.down_proj"], {})
    assert {k: awq[k] for k in ("quant_method", "version", "bits", "group_size", "zero_point")} == {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
    }
    assert awq["modules_to_not_convert"] == ["model.layers.0.mlp.down_proj"]
    assert list(awq["dynamic"]) == [r"-:^model\.layers\.0\.mlp\.down_proj$"]  # gptqmodel reads only this
