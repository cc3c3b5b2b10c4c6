"""Warsha's engine beside its peers (vLLM, llama.cpp): the arithmetic that turns runs into figures.

`python -m benchmarks.serve_peers` and `python -m benchmarks.spec_peers` run the engines; what they
report is computed here, so it is tested against rows whose answer is known:

- `latency_percentiles`: a peer runner's raw per-request TTFT/TPOT lists, summarised with the
  same percentile as the engine's own stats (`serve.stats.percentile`);
- `merge_rounds`: one row per engine from interleaved rounds (the median tok/s);
- `warsha_vs_best_peer`: Warsha's best figure over the best peer's at a bit width;
- `abba_order`, `paired_ratios`: two engines in alternating pairs (AB BA AB ...) and the ratio of
  each pair, so a host whose speed drifts over minutes moves both sides of every ratio alike;
- `spec_summary`, `spec_comparisons`: speculative rows against the same engine's plain rows;
- `checkpoint_key`, `staged_checkpoint`: a checkpoint laid out for llama.cpp's converter, which
  reads a tokenizer beside the weights (a random benchmark checkpoint has none, so a placeholder
  SentencePiece model with one piece per id is written: only ids are ever fed).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

from serve.stats import percentile

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def latency_percentiles(job: dict[str, Any]) -> dict[str, Any]:
    """`job` with its raw `ttft_s`/`tpot_s` lists replaced by their p50 and p99."""
    out = {k: v for k, v in job.items() if k not in ("ttft_s", "tpot_s")}
    for name in ("ttft", "tpot"):
        values = job.get(f"{name}_s") or []
        out[f"{name}_p50"], out[f"{name}_p99"] = percentile(values, 50), percentile(values, 99)
    return out


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per engine: the median tok/s over rounds (all kept in `tok_s_rounds`).

    Why: the host's memory bandwidth drifts by tens of percent within minutes; engines measured
    one after another in a single round can see different machines. Rounds interleave them.
    """
    merged = [dict(row) for row in rounds[0]]
    for i, row in enumerate(merged):
        rates = [r[i]["tok_s"] for r in rounds if "tok_s" in r[i]]
        if not rates:
            continue
        row["tok_s"], row["tok_s_rounds"] = statistics.median(rates), rates
        row["of_bound"] = row["tok_s"] / row["bound_tok_s"]
    return merged


def best_pair(rows: list[dict[str, Any]], bits: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The fastest Warsha row and the fastest peer row at `bits` (16 also counts 32-bit runs of the
    16-bit checkpoint; HF is the floor, never a peer), or None when either side has none."""
    ok = [r for r in rows if "tok_s" in r and (r["bits"] == bits or (bits == 16 and r["bits"] == 32))]
    ours = [r for r in ok if r["engine"].startswith("warsha")]
    theirs = [r for r in ok if not r["engine"].startswith(("warsha", "HF"))]
    if not ours or not theirs:
        return None
    return max(ours, key=lambda r: r["tok_s"]), max(theirs, key=lambda r: r["tok_s"])


def warsha_vs_best_peer(rows: list[dict[str, Any]], bits: int) -> tuple[float, str] | None:
    """Best Warsha figure at `bits` over the best peer's (`best_pair`), and that peer's name."""
    pair = best_pair(rows, bits)
    return None if pair is None else (pair[0]["tok_s"] / pair[1]["tok_s"], pair[1]["engine"])


def round_ratios(rows: list[dict[str, Any]], bits: int) -> dict[str, Any] | None:
    """`best_pair`'s two engines compared round by round (`paired_ratios` over `tok_s_rounds`).

    Why: a median per engine can take its two figures from different rounds, so on a host whose
    speed drifts (memory bandwidth 56 -> 37 GB/s within one run) the ratio of medians can say 1.57x
    where the rounds say 1.07-1.56x; the engines of one round ran minutes apart, not hours."""
    pair = best_pair(rows, bits)
    if pair is None or "tok_s_rounds" not in pair[0] or "tok_s_rounds" not in pair[1]:
        return None
    ours, theirs = pair[0]["tok_s_rounds"], pair[1]["tok_s_rounds"]
    rounds = [{"warsha": a, "peer": b} for a, b in zip(ours, theirs, strict=False)]
    return {"warsha": pair[0]["engine"], "peer": pair[1]["engine"], **paired_ratios(rounds, "warsha", "peer")}


def abba_order(pairs: int, a: str, b: str) -> list[tuple[str, str]]:
    """The run order of `pairs` pairs of engines `a` and `b`: a b, b a, a b, ...

    Why: the shared host's speed drifts monotonically over minutes (the same code moved by a
    third between runs); in AB AB order the second engine always runs on the later machine, in
    ABBA order each engine is first as often as second.
    """
    return [(a, b) if i % 2 == 0 else (b, a) for i in range(pairs)]


def paired_ratios(pairs: list[dict[str, float]], num: str, den: str) -> dict[str, Any]:
    """Each pair's `num` / `den` tok/s, with their median, geometric mean and range.

    A pair missing either figure (an engine failed) is left out of the summary and counted.
    """
    ratios = [p[num] / p[den] for p in pairs if p.get(num) and p.get(den)]
    out: dict[str, Any] = {"ratios": ratios, "pairs": len(pairs), "failed_pairs": len(pairs) - len(ratios)}
    if ratios:
        out["median"] = statistics.median(ratios)
        out["geomean"] = math.exp(statistics.fmean(math.log(r) for r in ratios))
        out["min"], out["max"] = min(ratios), max(ratios)
    return out


def spec_summary(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Speedup over the same engine and dtype without the draft, and output identity with it."""
    table = {}
    for name, r in rows.items():
        if "tok_per_s" not in r:
            table[name] = {"error": r.get("error")}
            continue
        plain = rows.get(name.rsplit(" ", 1)[0] + " plain", {})
        entry: dict[str, Any] = {"tok_per_s": r["tok_per_s"]}
        if not name.endswith(" plain") and "tok_per_s" in plain:
            entry["speedup"] = r["tok_per_s"] / plain["tok_per_s"]
            entry["identical_to_plain"] = r["outputs"] == plain["outputs"]
        for key in ("acceptance_rate", "mean_accepted_length", "tok_s_rounds"):
            if r.get(key) is not None:
                entry[key] = r[key]
        table[name] = entry
    return table


def spec_comparisons(rows: dict[str, dict[str, Any]], raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Warsha's speculative tok/s (best dtype) over vLLM's, and float32 output identity."""
    out: dict[str, Any] = {}
    w = max((rows[n]["tok_per_s"] for n in rows if n.startswith("warsha") and n.endswith("spec")), default=None)
    v = rows.get("vLLM float32 spec", {}).get("tok_per_s")
    if w and v:
        out["warsha spec / vLLM spec"] = round(w / v, 3)
    a, b = raw.get("warsha float32 spec", {}), raw.get("vLLM float32 spec", {})
    if "outputs" in a and "outputs" in b:
        out["float32 spec outputs identical, Warsha vs vLLM"] = a["outputs"] == b["outputs"]
    w, v = rows.get("warsha float32 lookup", {}), rows.get("vLLM float32 lookup", {})
    if "tok_per_s" in w and "tok_per_s" in v:
        out["warsha lookup / vLLM lookup (float32)"] = round(w["tok_per_s"] / v["tok_per_s"], 3)
    return out


def checkpoint_key(model_dir: Path) -> str:
    """A key that changes when the checkpoint's weights or config change."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def write_placeholder_spm(path: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A SentencePiece model with `vocab_size` pieces, <unk>=0 and control <s>/</s> at the config's ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = vocab_size
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, bos, eos, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    for i in range(vocab_size):
        piece = m.pieces.add()
        if i == 0:
            piece.piece, piece.type = "<unk>", pb.ModelProto.SentencePiece.UNKNOWN
        elif i in (bos, eos):
            piece.piece, piece.type = ("<s>" if i == bos else "</s>"), pb.ModelProto.SentencePiece.CONTROL
        else:
            piece.piece, piece.type = f"\u2581t{i}", pb.ModelProto.SentencePiece.NORMAL
        piece.score = -float(i)
    path.write_bytes(m.SerializeToString())


def staged_checkpoint(model_dir: Path, stage: Path) -> Path:
    """`model_dir` as symlinks, plus a placeholder tokenizer.model when it has no tokenizer of its own."""
    stage.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = stage / f.name
        if f.is_file() and not link.exists():
            link.symlink_to(f.resolve())
    if not any((model_dir / t).is_file() for t in TOKENIZER_FILES):
        cfg = json.loads((model_dir / "config.json").read_text())
        write_placeholder_spm(
            stage / "tokenizer.model",
            int(cfg["vocab_size"]),
            int(cfg.get("bos_token_id", 1)),
            int(cfg.get("eos_token_id", 2)),
        )
    return stage
