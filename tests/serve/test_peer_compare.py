"""serve.roofline and serve.peer_compare: what decides the figures the peer benchmarks report.

The roofline's byte counts are checked against serve's own KV cache allocation and a hand count
of a small checkpoint, the vLLM runner's latencies summarised with serve.stats' percentile, the
placeholder tokenizer the llama.cpp converter reads against sentencepiece itself, and the Warsha /
best-peer ratio and the speculative speedups against rows whose answer is known. The peers
themselves never run here (they need their venvs).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from serve import peer_compare
from serve import roofline as rl
from serve.kv_cache import KVCache
from serve.stats import percentile


def _config(tmp_path: Path, **over: int) -> Path:
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, **over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_kv_bytes_per_token_matches_the_engines_cache(tmp_path: Path) -> None:
    d = _config(tmp_path)
    blocks, block_size = 5, 16
    for dtype in (torch.bfloat16, torch.float32):
        kv = KVCache(3, blocks, block_size, 2, 8, dtype, torch.device("cpu"))
        held = kv.k.numel() * kv.k.element_size() + kv.v.numel() * kv.v.element_size()
        assert rl.kv_bytes_per_token(d, dtype.itemsize) == held // (blocks * block_size)


def test_checkpoint_decode_bytes_skips_the_embedding_and_g_idx(tmp_path: Path) -> None:
    state = {
        "model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.qweight": torch.zeros(4, 48, dtype=torch.int32),
        "model.layers.0.mlp.up_proj.scales": torch.zeros(1, 48, dtype=torch.float16),
        "model.layers.0.mlp.up_proj.g_idx": torch.zeros(32, dtype=torch.int32),
        "model.norm.weight": torch.zeros(32, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    stored = 4 * 48 * 4 + 48 * 2 + 32 * 2 + 64 * 32 * 2
    assert rl.checkpoint_decode_bytes(tmp_path) == stored
    floats = 48 + 32 + 64 * 32  # re-priced at 4 bytes; the packed int32 stays as stored
    assert rl.checkpoint_decode_bytes(tmp_path, 4) == 4 * 48 * 4 + floats * 4
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64}))
    assert rl.head_bytes_saved_int8(tmp_path) == 64 * 32 - 4 * 64


def test_checkpoint_decode_bytes_counts_a_tied_head(tmp_path: Path) -> None:
    """A tied checkpoint has no lm_head.*: its head reads the whole embedding table every step,
    in 16 bits or as the int8 rows (and scales) of an ``embedding_bits: 8`` export."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64}))
    norm = {"model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)}
    save_file(
        {"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16), **norm},
        str(tmp_path / "model.safetensors"),
    )
    assert rl.checkpoint_decode_bytes(tmp_path) == (64 * 32 + 32) * 2
    assert rl.head_bytes_saved_int8(tmp_path) == 64 * 32 - 4 * 64
    int8 = {
        "model.embed_tokens.weight_int8": torch.zeros(64, 32, dtype=torch.int8),
        "model.embed_tokens.weight_scale": torch.zeros(64, dtype=torch.float32),
    }
    save_file({**int8, **norm}, str(tmp_path / "model.safetensors"))
    assert rl.checkpoint_decode_bytes(tmp_path) == 64 * 32 + 64 * 4 + 32 * 2
    assert rl.head_bytes_saved_int8(tmp_path) == 0


def test_roofline_bound_is_bandwidth_over_step_bytes() -> None:
    r = rl.roofline(1000, 10, 50.0, 3000.0)
    assert r["step_bytes"] == 1500 and r["bound_tok_s"] == 2.0


def test_vllm_runner_latencies_use_serves_percentile() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 64):
        ttft, tpot = [rng.random() for _ in range(n)], [rng.random() for _ in range(n)]
        job = peer_compare.latency_percentiles({"tok_per_s": 3.0, "ttft_s": ttft, "tpot_s": tpot})
        assert job["tok_per_s"] == 3.0 and "ttft_s" not in job and "tpot_s" not in job
        for q in (50, 99):
            assert job[f"ttft_p{q}"] == pytest.approx(percentile(ttft, q))
            assert job[f"tpot_p{q}"] == pytest.approx(percentile(tpot, q))
    assert peer_compare.latency_percentiles({"ttft_s": [], "tpot_s": []})["ttft_p50"] is None


def test_placeholder_tokenizer_maps_every_id(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")

    peer_compare.write_placeholder_spm(tmp_path / "tokenizer.model", 300, 1, 2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert sp.vocab_size() == 300
    assert sp.unk_id() == 0 and sp.bos_id() == 1 and sp.eos_id() == 2
    assert sp.is_control(1) and sp.is_control(2) and sp.is_unknown(0)
    assert len({sp.id_to_piece(i) for i in range(300)}) == 300
    assert sp.piece_to_id("\u2581t257") == 257


def test_staged_checkpoint_links_weights_and_adds_a_tokenizer_only_when_missing(tmp_path: Path) -> None:
    pytest.importorskip("sentencepiece")

    (tmp_path / "src").mkdir()
    src = _config(tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"w")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 1, "eos_token_id": 2}))
    stage = peer_compare.staged_checkpoint(src, tmp_path / "stage")
    assert (stage / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert (stage / "tokenizer.model").is_file()
    (src / "tokenizer.json").write_text("{}")
    stage2 = peer_compare.staged_checkpoint(src, tmp_path / "stage2")
    assert not (stage2 / "tokenizer.model").exists() and (stage2 / "tokenizer.json").is_symlink()
    key = peer_compare.checkpoint_key(src)
    (src / "model.safetensors").write_bytes(b"changed")
    assert peer_compare.checkpoint_key(src) != key


def test_warsha_vs_best_peer_ratio() -> None:

    rows = [
        {"bits": 16, "engine": "warsha bf16", "tok_s": 8.0},
        {"bits": 32, "engine": "warsha fp32", "tok_s": 4.0},
        {"bits": 16, "engine": "vLLM bf16", "tok_s": 5.0},
        {"bits": 32, "engine": "vLLM fp32", "tok_s": 10.0},
        {"bits": 16, "engine": "HF generate bf16 (floor)", "tok_s": 100.0},
        {"bits": 4, "engine": "llama.cpp Q4_0", "tok_s": 20.0},
        {"bits": 4, "engine": "vLLM int4", "error": "refused"},
    ]
    assert peer_compare.warsha_vs_best_peer(rows, 16) == (0.8, "vLLM fp32")  # HF is the floor, never the best peer
    assert peer_compare.warsha_vs_best_peer(rows, 4) is None  # no Warsha 4-bit row


def test_rounds_merge_to_the_median_and_keep_every_rate() -> None:

    def rows(w: float, lc: float) -> list[dict]:
        return [
            {"engine": "warsha bf16", "tok_s": w, "bound_tok_s": 40.0},
            {"engine": "llama.cpp F16", "tok_s": lc, "bound_tok_s": 40.0},
            {"engine": "broken", "error": "x"},
        ]

    merged = peer_compare.merge_rounds([rows(30, 20), rows(10, 22), rows(20, 30)])
    assert [r.get("tok_s") for r in merged] == [20, 22, None]
    assert merged[0]["tok_s_rounds"] == [30, 10, 20] and merged[0]["of_bound"] == 0.5
    assert merged[2] == {"engine": "broken", "error": "x"}


def test_round_ratios_compare_the_best_engines_within_each_round() -> None:
    """The medians' ratio (here 20 / 20 = 1.0x) against the rounds' own ratios, by a loop."""
    rows = [
        {"bits": 16, "engine": "warsha bf16", "tok_s": 20.0, "tok_s_rounds": [30.0, 10.0, 20.0]},
        {"bits": 16, "engine": "warsha bf16, whole head", "tok_s": 12.0, "tok_s_rounds": [12.0, 12.0, 12.0]},
        {"bits": 16, "engine": "llama.cpp F16", "tok_s": 20.0, "tok_s_rounds": [15.0, 25.0, 20.0]},
        {"bits": 16, "engine": "HF generate bf16 (floor)", "tok_s": 90.0, "tok_s_rounds": [90.0, 90.0, 90.0]},
    ]
    out = peer_compare.round_ratios(rows, 16)
    assert out is not None and (out["warsha"], out["peer"]) == ("warsha bf16", "llama.cpp F16")
    want = [w / p for w, p in zip([30.0, 10.0, 20.0], [15.0, 25.0, 20.0], strict=True)]
    assert out["ratios"] == pytest.approx(want) and out["median"] == pytest.approx(1.0)
    assert peer_compare.warsha_vs_best_peer(rows, 16) == (1.0, "llama.cpp F16")
    assert peer_compare.round_ratios(rows, 4) is None
    single = [{k: v for k, v in r.items() if k != "tok_s_rounds"} for r in rows]
    assert peer_compare.round_ratios(single, 16) is None  # one round: nothing to pair


def test_abba_order_puts_each_engine_first_as_often_as_second() -> None:
    order = peer_compare.abba_order(4, "warsha", "vllm")
    assert order == [("warsha", "vllm"), ("vllm", "warsha"), ("warsha", "vllm"), ("vllm", "warsha")]
    assert sum(o[0] == "warsha" for o in order) == sum(o[1] == "warsha" for o in order)
    assert peer_compare.abba_order(0, "a", "b") == []


def test_paired_ratios_against_a_loop_and_a_failed_pair() -> None:
    pairs = [{"w": 300.0, "v": 200.0}, {"w": 200.0, "v": 250.0}, {"w": 240.0, "v": 240.0}, {"w": 100.0}]
    out = peer_compare.paired_ratios(pairs, "w", "v")
    expect = [1.5, 0.8, 1.0]
    assert out["ratios"] == pytest.approx(expect) and out["pairs"] == 4 and out["failed_pairs"] == 1
    product = 1.0
    for r in expect:
        product *= r
    assert out["geomean"] == pytest.approx(product ** (1 / 3))
    assert out["median"] == pytest.approx(1.0) and (out["min"], out["max"]) == (0.8, 1.5)
    assert peer_compare.paired_ratios([{"w": 1.0}], "w", "v") == {"ratios": [], "pairs": 1, "failed_pairs": 1}


def test_mixed_pairs_alternate_engines_and_keep_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve_peers' pairs: ABBA order as run, every pair's figures kept beside the summary, and a
    failed vLLM run left out of the ratios with its error."""
    from benchmarks import serve_peers

    ran: list[str] = []
    rates = iter([200.0, 250.0, 240.0, 200.0, 210.0])

    def fake_warsha(*_args: object, **_kw: object) -> dict:
        ran.append("warsha")
        return {"tok_per_s": next(rates)}

    def fake_vllm(*_args: object, **_kw: object) -> dict:
        ran.append("vllm")
        if len(ran) == 6:
            return {"error": "vllm_runner.py exited 1"}
        return {"jobs": {"mixed": {"tok_per_s": next(rates)}}}

    monkeypatch.setattr(serve_peers, "warsha_run", fake_warsha)
    monkeypatch.setattr(serve_peers, "run_vllm", fake_vllm)
    args = SimpleNamespace(mixed_pairs=3)
    out = serve_peers.mixed_pairs(Path("m"), [([1, 2], 3)], args)  # type: ignore[arg-type]
    assert ran == ["warsha", "vllm", "vllm", "warsha", "warsha", "vllm"]
    assert [p["order"] for p in out["runs"]] == [["warsha", "vllm"], ["vllm", "warsha"], ["warsha", "vllm"]]
    assert out["ratios"] == pytest.approx([200 / 250, 200 / 240]) and out["failed_pairs"] == 1
    assert out["runs"][2]["vllm"] is None and "exited 1" in out["runs"][2]["vllm_error"]


def test_spec_peers_speedups_identity_and_ratio_from_known_rows() -> None:
    """Each speculative row is divided by its own engine and dtype's plain row, outputs compared
    with that row's; the headline ratio takes Warsha's faster dtype; a failed peer stays an
    error row instead of a figure."""
    raw = {
        "warsha bfloat16 plain": {"tok_per_s": 10.0, "outputs": [[1, 2]]},
        "warsha bfloat16 spec": {"tok_per_s": 25.0, "outputs": [[1, 2]], "acceptance_rate": 0.8},
        "warsha float32 plain": {"tok_per_s": 8.0, "outputs": [[1, 2]]},
        "warsha float32 spec": {"tok_per_s": 12.0, "outputs": [[1, 3]]},
        "vLLM float32 plain": {"tok_per_s": 5.0, "outputs": [[1, 2]]},
        "vLLM float32 spec": {"tok_per_s": 10.0, "outputs": [[1, 3]]},
    }
    rows = peer_compare.spec_summary(raw)
    assert rows["warsha bfloat16 spec"]["speedup"] == pytest.approx(2.5)
    assert rows["warsha bfloat16 spec"]["identical_to_plain"] is True
    assert rows["warsha float32 spec"]["speedup"] == pytest.approx(1.5)
    assert rows["warsha float32 spec"]["identical_to_plain"] is False
    assert rows["vLLM float32 spec"]["speedup"] == pytest.approx(2.0)
    assert "speedup" not in rows["vLLM float32 plain"]
    cmp = peer_compare.spec_comparisons(rows, raw)
    assert cmp["warsha spec / vLLM spec"] == pytest.approx(2.5)
    assert cmp["float32 spec outputs identical, Warsha vs vLLM"] is True
    failed = peer_compare.spec_summary({**raw, "vLLM float32 spec": {"error": "boom"}})
    assert failed["vLLM float32 spec"] == {"error": "boom"}
    assert "warsha spec / vLLM spec" not in peer_compare.spec_comparisons(failed, raw)
