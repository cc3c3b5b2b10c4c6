"""KV cache copy-on-write copies, statistics definitions, and the tokenizer wrapper."""

from pathlib import Path

import pytest
import torch

from serve.kv_cache import KVCache
from serve.stats import EngineStats, percentile
from serve.tokenizer import Tokenizer, first_vocab_difference
from tests.serve.conftest import write_tokenizer


def test_kv_write_and_copy_blocks() -> None:
    kv = KVCache(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=5, dtype=torch.float32)
    k, v = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    kv.write(1, torch.tensor([2, 3]), k, v)  # block 1
    kv.copy_blocks([(1, 3)])
    torch.testing.assert_close(kv.k[1, :, 6:8].transpose(0, 1), k)
    torch.testing.assert_close(kv.v[1, :, 6:8].transpose(0, 1), v)
    assert KVCache.bytes_per_block(2, 16, 4, 32, torch.bfloat16) == 2 * 2 * 16 * 4 * 32 * 2


def test_stats_definitions() -> None:
    st = EngineStats()
    st.record_request(arrival=0.0, scheduled=0.5, first_token=1.0, finished=3.0, num_output=5)
    st.record_request(arrival=0.0, scheduled=0.1, first_token=0.2, finished=0.2, num_output=1)
    st.spec_proposed, st.spec_accepted, st.spec_verifications, st.spec_emitted = 10, 7, 4, 11
    st.kv_allocated_slots, st.kv_used_slots, st.kv_reserved_request_slots = 100, 90, 300
    assert st.tpot == [0.5] and st.ttft == [1.0, 0.2] and st.queue_time == [0.5, 0.1]
    assert st.acceptance_rate == 0.7 and st.mean_accepted_length == 2.75
    assert st.kv_waste == pytest.approx(0.1) and st.kv_waste_contiguous == pytest.approx(0.7)
    assert st.goodput(ttft_slo=0.5, tpot_slo=1.0) == 0.5
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([], 50) is None
    assert st.summary()["ttft_p50"] == pytest.approx(0.6)


def test_tokenizer_roundtrip_bos_eos_and_vocab_diff(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "a")
    tok = Tokenizer(tmp_path / "a")
    ids = tok.encode("مرحبا the fox")
    assert ids[0] == tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    assert tok.decode(ids) == "مرحبا the fox"
    assert first_vocab_difference(tok, tok) is None
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path / "missing")


def test_serve_imports_neither_warsha_nor_training_stack() -> None:
    import subprocess
    import sys

    code = (
        "import sys, serve, serve.engine, serve.spec_decode, serve.quant; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('warsha', 'transformers', 'peft', 'deepspeed', "
        "'bitsandbytes')]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
