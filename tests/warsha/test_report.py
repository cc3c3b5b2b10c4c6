"""report.md is built from manifests: every stage's figures appear, with plots."""

from __future__ import annotations

import shutil
from pathlib import Path

from warsha.artifacts import read_manifest
from warsha.report import write_report


def test_report_from_manifests(tiny_artifact: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_artifact, run / "bootstrap")
    report = write_report(run).read_text()
    m = read_manifest(run / "bootstrap")["metrics"]
    assert "## bootstrap (`bootstrap`)" in report
    assert f"| en/bits_per_char | {m['en']['bits_per_char']:.4g} |" in report
    assert (run / "report" / "bootstrap-bpc.png").stat().st_size > 1000
    assert "nothing (trained here)" in report


def test_stage_plots_from_synthetic_manifests(tmp_path: Path) -> None:
    import json

    from warsha.report_plots import draw_plots

    extend = {
        "stage": "tokenizer_ext.extend",
        "metrics": {
            "fertility": {
                "ar": {"before": {"tokens_per_word": 4.5}, "after": {"tokens_per_word": 1.2}},
                "en": {"before": {"tokens_per_word": 1.5}, "after": {"tokens_per_word": 1.5}},
            }
        },
    }
    quant = {
        "stage": "quantize.gptq",
        "metrics": {
            "method": "gptq",
            "perplexity_increase_rel": {"ar": 0.01},
            "rtn_perplexity_increase_rel": {"ar": 0.02},
        },
    }
    for m, name in ((extend, "extend"), (quant, "gptq")):
        [(title, png, note)] = draw_plots(json.loads(json.dumps(m)), tmp_path, name)
        assert png is not None and png.stat().st_size > 1000, note
    [(_, png, note)] = draw_plots({"stage": "quantize.awq", "metrics": {}}, tmp_path, "awq")
    assert png is None and "perplexity_increase_rel" in note


def test_adaptation_latency_and_quantization_summary_plots(tmp_path: Path) -> None:
    from warsha.report_plots import draw_plots, plot_quant_summary, quant_rows

    curve = [{"step": s, "ar": 4.0 - s / 10, "en": 1.5} for s in (0, 10, 20)]
    adapt = {
        "stage": "tokenizer_ext.adapt",
        "metrics": {"extended": {"bits_per_char_curve": curve}, "base_same_budget": {"bits_per_char_curve": curve}},
    }
    [(_, png, note)] = draw_plots(adapt, tmp_path, "adapt")
    assert png is not None and png.stat().st_size > 1000, note
    engine = {"ttft_s": [0.01, 0.02, 0.03], "tpot_s": [0.005, 0.006]}
    validate = {"stage": "serve.validate", "metrics": {"batch1": {"plain": engine, "speculative": engine}}}
    plots = draw_plots(validate, tmp_path, "validate")
    assert [p.name for _, p, _ in plots] == ["validate-ttft.png", "validate-tpot.png"]
    ppl = {"ar": {"perplexity": 10.0}, "en": {"perplexity": 12.0}}
    gptq = {
        "stage": "quantize.gptq",
        "metrics": {
            "method": "gptq",
            "quantized": ppl,
            "rtn": ppl,
            "unquantized": ppl,
            "size_bytes": 10,
            "input_size_bytes": 40,
        },
    }
    [(_, png, note)] = plot_quant_summary([("gptq", gptq)], tmp_path)
    assert png is not None and png.stat().st_size > 1000, note
    [(_, png, note)] = plot_quant_summary([("adapt", adapt)], tmp_path)
    assert png is None and "no quantize stage" in note
    on_yarn = {**gptq, "inputs": [{"role": "model", "path": "runs/x/yarn"}]}
    awq = {**on_yarn, "stage": "quantize.awq", "metrics": {**gptq["metrics"], "method": "awq"}}
    draft_q4 = {
        "stage": "quantize.rtn",
        "inputs": [{"role": "model", "path": "runs/x/draft"}],
        "metrics": gptq["metrics"],
    }
    rows = quant_rows([("gptq", on_yarn), ("awq", awq), ("draft_q4", draft_q4)])
    assert list(rows) == ["unquantized", "rtn", "gptq", "awq"]  # the draft's own quantization stays off this axis
    types = {
        name: {"size_bytes": size, "ar": {"perplexity": 10.5}, "file": "f"}
        for name, size in (("F16", 80), ("Q4_K_M", 9))
    }
    gguf = {"stage": "quantize.gguf", "inputs": on_yarn["inputs"], "metrics": {"types": types}}
    e8 = {**on_yarn, "metrics": {**gptq["metrics"], "embedding_bits": 8}}
    rows = quant_rows([("gptq", e8), ("gguf", gguf)])
    assert list(rows) == ["unquantized", "rtn", "gptq, int8 embedding", "GGUF F16", "GGUF Q4_K_M"]
    assert rows["GGUF Q4_K_M"] == ({"ar": 10.5}, 9)
    from warsha.report import quant_table

    table = quant_table([("gptq", on_yarn), ("gguf", gguf)])
    assert table[0] == "| method | ppl ar | ppl en | MiB |"
    assert "| GGUF Q4_K_M | 10.500 |  | 0.0 |" in table and "| rtn | 10.000 | 12.000 |  |" in table


def test_chat_section_shows_every_artifact_and_the_answers() -> None:
    from warsha.report import chat_section

    setup = {"chat_template": True, "chat_template_sha256": "ab" * 32, "stop_ids": [2, 7]}
    lost = {"chat_template": False, "chat_template_sha256": None, "stop_ids": [2]}
    chat = {
        "ar": {"turn_ended": 0.75, "mean_tokens": 12.5, "script_share": 0.9},
        "en": {"turn_ended": 1.0, "mean_tokens": 8.0, "script_share": None},
        "special_tokens": ["<|im_end|>"],
        "answers": {"ar": [], "en": []},
    }
    adapt = {"stage": "tokenizer_ext.adapt", "chat": setup, "metrics": {"base_model": {"chat": chat}, "extended": {}}}
    arts = [(Path("run/import"), {"stage": "import", "chat": setup}), (Path("run/adapt"), adapt)]
    lines = chat_section([*arts, (Path("run/gptq"), {"stage": "quantize.gptq", "chat": lost})])
    assert "| `import` | `abababababab` | 2, 7 |" in lines
    assert "| `gptq` | **none** | 2 |" in lines
    assert "| base_model | ar | 75% | 12.5 | 90.0% | `<\\|im_end\\|>` |" in lines  # | escaped in a cell
    assert "| base_model | en | 100% | 8.0 | - | `<\\|im_end\\|>` |" in lines
    assert not any(line.startswith("| extended") for line in lines)  # no chat measured for it
    assert chat_section([(Path("run/bootstrap"), {"stage": "bootstrap", "chat": lost})]) == []
