"""The markdown view of a GPU-check report: environment, one table of checks, every skip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _detail(detail: dict[str, Any]) -> str:
    """A check's numbers on one line (long lists cut)."""
    text = json.dumps(detail, default=str, separators=(", ", ": "))
    return text if len(text) <= 300 else text[:297] + "..."


def write_markdown(report: dict[str, Any], path: Path) -> None:
    """`report.md`: what ran where, every check's verdict, and every skipped item with its reason."""
    env = report["environment"]
    device = env.get("gpu") or f"CPU ({env.get('cpu')}, {env.get('cpu_count')} cores), no CUDA"
    lines = [
        f"# GPU check: {report['status']} ({report['seconds']} s{', quick subset' if report['quick'] else ''})",
        "",
        f"Device: {device}. torch {env.get('torch')}, triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}, peft {env.get('peft')}, bitsandbytes {env.get('bitsandbytes')}; "
        f"TRITON_INTERPRET={env.get('triton_interpret')}.",
        "",
        "| part | check | verdict | numbers |",
        "|---|---|---|---|",
    ]
    skips = []
    for part in report["parts"]:
        name = part["part"]
        lines.append(f"| **{name}** | (part, {part.get('seconds')} s) | **{part['status']}** | |")
        for check in part.get("checks", []):
            lines.append(f"| {name} | {check['name']} | {check['status']} | `{_detail(check['detail'])}` |")
        if part.get("error"):
            lines.append(f"| {name} | error | fail | `{part['error'].strip().splitlines()[-1][:300]}` |")
        if part.get("note"):
            lines.append(f"| {name} | note | | {part['note']} |")
        skips += [f"- {name}: {s['what']}: {s['why']}" for s in part.get("skipped", [])]
    lines += ["", "## Skipped", ""] + (skips or ["- nothing"])
    path.write_text("\n".join(lines) + "\n")
