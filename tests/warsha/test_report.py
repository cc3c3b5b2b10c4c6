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
