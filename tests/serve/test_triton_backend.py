"""Backend selection, lazy triton import, and the model's forward on the Triton backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve.attention import SeqChunk, TorchPagedAttention, get_backend
from tests.serve.triton_cases import kernel_device

REPO = Path(__file__).resolve().parents[2]


def test_get_backend_picks_by_device_and_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    from serve.attention.triton_backend import TritonPagedAttention

    device = kernel_device()  # cuda compiled, or cpu under the interpreter
    assert isinstance(get_backend("cpu"), TorchPagedAttention)
    assert isinstance(get_backend("cpu", prefer="torch"), TorchPagedAttention)
    if device.type == "cuda":
        assert isinstance(get_backend("cuda"), TritonPagedAttention)
    forced = get_backend(device, prefer="triton", partition_size=64)
    assert isinstance(forced, TritonPagedAttention) and forced.partition_size == 64
    with pytest.raises(ValueError, match="only apply to the triton backend"):
        get_backend("cpu", partition_size=64)
    with pytest.raises(ValueError, match="prefer='cuda' is not a backend"):
        get_backend("cpu", prefer="cuda")
    with pytest.raises(ValueError, match="device 'meta'"):
        get_backend("meta", prefer="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("cpu", prefer="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonPagedAttention("cpu")


def test_cpu_serving_never_imports_triton(tiny_dir: Path) -> None:
    """`import serve`, the engine module and a CPU model forward leave triton unimported."""
    code = (
        "import sys, serve, serve.engine, serve.attention\n"
        "from serve.model import DecoderModel\n"
        "m = DecoderModel.load(sys.argv[1], 'float32')\n"
        "assert m.backend.name == 'torch'\n"
        "assert m.prefill_logits([3, 4, 5, 6]).isfinite().all()\n"
        "bad = sorted(k for k in sys.modules if k == 'triton' or k.startswith(('triton.', "
        "'serve.attention.triton', 'serve.triton')))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_model_forward_on_triton_backend(tiny_dir: Path) -> None:
    """Chunked prefill of two prompts then decode steps: logits equal the torch backend's."""
    from serve.model import DecoderModel, ForwardBatch

    device = kernel_device()
    models = {name: DecoderModel.load(tiny_dir, "float32", device=device) for name in ("torch", "triton")}
    models["torch"].backend = get_backend(device, prefer="torch")
    models["triton"].backend = get_backend(device, prefer="triton", partition_size=16)
    caches = {name: m.new_kv_cache(12, 16) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (37,), generator=gen).tolist(),
        torch.randint(3, 300, (21,), generator=gen).tolist(),
    ]
    tables = [[5, 0, 9], [3, 7]]
    # step 1: first 20 tokens of prompt 0 and all of prompt 1; step 2: the rest of prompt 0;
    # then three decode steps for both (the 37-token context spans three 16-token partitions)
    plan = [[(0, 0, 20), (1, 0, 21)], [(0, 20, 37)]] + [[(0, 37 + i, 38 + i), (1, 21 + i, 22 + i)] for i in range(3)]
    tokens = [list(p) for p in prompts]
    for step in plan:
        for seq, _lo, hi in step:  # decode steps feed a fixed token: both backends must agree anyway
            tokens[seq] += [17] * (hi - len(tokens[seq]))
        ids = [t for seq, lo, hi in step for t in tokens[seq][lo:hi]]
        chunks, start = [], 0
        for seq, lo, hi in step:
            chunks.append(SeqChunk(start, hi - lo, hi, tables[seq]))
            start += hi - lo
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor([p for _, lo, hi in step for p in range(lo, hi)]),
            chunks=chunks,
            logits_indices=torch.arange(len(ids)),
        )
        logits = {name: m.forward(batch, caches[name]) for name, m in models.items()}
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
