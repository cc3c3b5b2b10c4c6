"""``quantize.gguf``: Modelfile writing, options and errors in the default suite; the llama.cpp
conversion end to end as a slow test that needs the llama.cpp venv."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from quantize.gguf_run import llamacpp_tools
from quantize.ollama import FORMATS, chat_format, chat_template, modelfile
from quantize.stages import STAGES, GGUFParams
from warsha.config import RecipeError, parse_recipe
from warsha.schema import from_dict

LLAMACPP = Path(os.path.expanduser(GGUFParams().llamacpp_venv))
GEMMA_JINJA = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>"


def test_modelfile_for_a_chat_model(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA_JINJA}))
    fmt = chat_format(chat_template(tmp_path))
    assert fmt is not None and fmt.name == "gemma"
    text = modelfile("model-Q4_K_M.gguf", fmt, ["<eos>", "<end_of_turn>"], {"temperature": 0.7, "num_ctx": 4096})
    lines = text.splitlines()
    assert lines[0] == "FROM ./model-Q4_K_M.gguf"
    assert lines[1].startswith('TEMPLATE """{{- range $i, $_ := .Messages }}')
    assert text.count("PARAMETER stop") == 2  # <end_of_turn> once, though both the family and EOS name it
    assert 'PARAMETER stop "<end_of_turn>"' in lines and 'PARAMETER stop "<eos>"' in lines
    assert lines[-2:] == ["PARAMETER temperature 0.7", "PARAMETER num_ctx 4096"]


def test_modelfile_for_a_base_model_and_other_families(tmp_path: Path) -> None:
    assert chat_template(tmp_path) is None and chat_format(None) is None
    assert modelfile("m.gguf", None, ["</s>"], {}) == 'FROM ./m.gguf\nPARAMETER stop "</s>"\n'
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")
    assert chat_format(chat_template(tmp_path)).name == "chatml"  # type: ignore[union-attr]
    assert {f.name for f in FORMATS} == {"gemma", "chatml", "llama3"}
    with pytest.raises(ValueError, match="matches none of the Modelfile formats.*add its family"):
        chat_format("{% for m in messages %}### User: {{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="ollama_parameters.stop"):
        modelfile("m.gguf", None, [], {"stop": "x"})


def test_options_are_checked() -> None:
    problems: list[str] = []
    from_dict(GGUFParams, {"types": ["Q4_K_M", "Q4_K_X"], "modelfile_type": "Q8_0"}, "p", problems)
    assert problems[0].startswith("p.types: unknown llama.cpp type 'Q4_K_X' (known: F16, Q4_0")
    assert problems[1] == "p.modelfile_type: 'Q8_0' is neither F16 nor one of types ['Q4_K_M', 'Q4_K_X']"
    recipe = {"name": "t", "stages": [{"stage": "bootstrap"}, {"stage": "quantize.gguf", "params": {"types": ["q4"]}}]}
    with pytest.raises(RecipeError, match=r"stages\[1\].params.types: unknown llama.cpp type 'q4'"):
        parse_recipe(recipe)


def test_missing_llamacpp_names_the_tool_and_the_setup_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        llamacpp_tools(str(tmp_path / "nowhere"))
    text = str(err.value)
    assert "llama-cpp-python and its convert_hf_to_gguf.py" in text
    assert f"bash benchmarks/peers/setup_llamacpp.sh {tmp_path / 'nowhere'}" in text
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").write_text("")
    with pytest.raises(FileNotFoundError, match="no .warsha-ready-\\* stamp"):
        llamacpp_tools(str(tmp_path / "v"))


def test_stage_stops_before_any_work_without_llamacpp(tmp_path: Path) -> None:
    class Ctx:  # anything the stage touched before the check would fail on these
        model_dir = tmp_path / "absent"
        out_dir = tmp_path / "out"
        is_main = True

    with pytest.raises(FileNotFoundError, match="setup_llamacpp.sh"):
        STAGES["gguf"].run(Ctx(), GGUFParams(llamacpp_venv=str(tmp_path / "none")))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def _llamacpp_missing() -> str | None:
    try:
        llamacpp_tools(str(LLAMACPP))
    except FileNotFoundError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_llamacpp_missing() is not None, reason=f"needs the llama.cpp venv: {_llamacpp_missing()}")
def test_gguf_stage_end_to_end(tmp_path: Path, corpus: Any) -> None:
    """A tiny Llama with the bootstrap's SentencePiece tokenizer, converted, quantized, checked."""
    from transformers import AutoTokenizer

    from tests.quantize.quant_fixtures import FakeContext, tiny_model
    from warsha.bootstrap import DEFAULT_TOKENIZER, tokenizer_file
    from warsha.sentencepiece_hf import sp_model_to_hf

    src = tmp_path / "src"
    sp_model_to_hf(tokenizer_file(DEFAULT_TOKENIZER), src)
    tok = AutoTokenizer.from_pretrained(src)
    model = tiny_model(vocab=len(tok), outliers=False)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(src)
    ctx = FakeContext(model_dir=src, out_dir=tmp_path / "gguf", the_corpus=corpus)
    ctx.checkpoint_dir = tmp_path / "ckpt"  # type: ignore[attr-defined]
    ctx.checkpoint_dir.mkdir()  # type: ignore[attr-defined]
    p = GGUFParams(types=["Q8_0", "Q4_K_M"], eval_documents=6, tokenize_documents=40, num_prompts=2, max_tokens=12)
    m = STAGES["gguf"].run(ctx, p)
    assert {t: m["tokenization"][t]["differing"] for t in ("ar", "en")} == {"ar": 0, "en": 0}
    g = m["greedy_f16_vs_serve_float32"]
    assert g["outputs_match"], g
    types = m["types"]
    assert set(types) == {"F16", "Q8_0", "Q4_K_M"}
    assert types["Q4_K_M"]["size_bytes"] < types["Q8_0"]["size_bytes"] < types["F16"]["size_bytes"]
    for lang in ("ar", "en"):
        assert abs(types["Q8_0"][lang]["perplexity_increase_rel"]) < 0.01  # 8 bits barely move a model
        assert types["F16"][lang]["tokens"] == types["Q4_K_M"][lang]["tokens"] > 100
    assert (ctx.out_dir / "model-Q4_K_M.gguf").is_file()
    assert (ctx.out_dir / "Modelfile").read_text().startswith("FROM ./model-Q4_K_M.gguf\n")


def test_extra_buffers_are_turned_off_through_the_default_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX hosts every later Llama load must see ``use_extra_bufts = False``; other fields stay."""
    import sys
    import types

    from quantize import gguf_tool

    class Params:
        use_extra_bufts = True
        n_gpu_layers = 7

    package, binding = types.ModuleType("llama_cpp"), types.ModuleType("llama_cpp.llama_cpp")
    binding.llama_model_default_params = Params  # type: ignore[attr-defined]
    package.llama_cpp = binding  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", binding)
    gguf_tool.skip_extra_buffers()
    p = binding.llama_model_default_params()  # type: ignore[attr-defined]
    assert (p.use_extra_bufts, p.n_gpu_layers) == (False, 7)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert gguf_tool.amx_host() == ("amx_int8" in flags)
