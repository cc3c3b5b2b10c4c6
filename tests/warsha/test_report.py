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

    extend = {"stage": "tokenizer_ext.extend", "metrics": {"fertility": {
        "ar": {"before": {"tokens_per_word": 4.5}, "after": {"tokens_per_word": 1.2}},
        "en": {"before": {"tokens_per_word": 1.5}, "after": {"tokens_per_word": 1.5}}}}}
    quant = {"stage": "quantize.gptq", "metrics": {"method": "gptq", "perplexity_increase_rel": {"ar": 0.01},
                                                  "rtn_perplexity_increase_rel": {"ar": 0.02}}}
    for m, name in ((extend, "extend"), (quant, "gptq")):
        [(title, png, note)] = draw_plots(json.loads(json.dumps(m)), tmp_path, name)
        assert png is not None and png.stat().st_size > 1000, note
    [(_, png, note)] = draw_plots({"stage": "quantize.awq", "metrics": {}}, tmp_path, "awq")
    assert png is None and "perplexity_increase_rel" in note
