"""Tokenizer extension, side by side: base vs. Warsha-extended vs. a naive append (peer style).

What it measures, on the held-out (validation) split of the bundled corpus, undiacritized:
  * fertility (tokens/word), chars/token and batch encode throughput of the fast tokenizers;
  * added pieces that nothing produces ("dead"), and English tokens changed;
  * with ``--adapt-model DIR``: the adaptation comparison (extend -> embed -> adapt QLoRA on the
    extended tokenizer vs. the same budget on the base tokenizer), bits per character.

The naive peer is the Chinese-LLaMA-Alpaca ``merge_tokenizers.py`` recipe: append every
target piece absent from the base with score 0, no reachability work.

Run on CPU (about 1 minute for tokenizers; adaptation adds the training time):
    .venv/bin/python -m benchmarks.tokenizer_bench
    .venv/bin/python -m benchmarks.tokenizer_bench --adapt-model runs/arabic-tiny/bootstrap --steps 150
    .venv/bin/python -m benchmarks.tokenizer_bench --from-run runs/arabic-tiny   # reuse a pipeline run
Writes benchmarks/results/tokenizer_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokenizer_ext import byte_bpe, extend, family, sp_bpe
from warsha.data import DataConfig, load_corpus
from warsha.evaluate import fertility, hf_encoder

RESULTS = Path(__file__).parent / "results"
MISTRAL = importlib.resources.files("mistral_common") / "data"


def throughput(tok: Any, texts: list[str], repeats: int = 5) -> float:
    """Characters encoded per second (best of ``repeats``), batch encode, no special tokens."""
    chars = sum(map(len, texts))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        tok(texts, add_special_tokens=False)
        best = min(best, time.perf_counter() - t0)
    return chars / best


def describe(name: str, tok: Any, base: Any, corpus: Any, first_added: int, dead: int | None) -> dict[str, Any]:
    """One row of the table."""
    ar, en = corpus.texts("ar", "validation"), corpus.texts("en", "validation")
    f_ar, f_en = fertility(hf_encoder(tok), ar), fertility(hf_encoder(tok), en)
    same = tok(en, add_special_tokens=False)["input_ids"] == base(en, add_special_tokens=False)["input_ids"]
    return {
        "tokenizer": name,
        "vocab": len(tok),
        "added": len(tok) - first_added,
        "ar_tokens_per_word": f_ar.tokens_per_word,
        "en_tokens_per_word": f_en.tokens_per_word,
        "ar_chars_per_token": f_ar.chars_per_token,
        "en_unchanged": same,
        "dead_added": dead,
        "encode_chars_per_s": throughput(tok, ar + en),
    }


def sp_rows(corpus: Any, added: int, tmp: Path) -> list[dict[str, Any]]:
    """Base SentencePiece, Warsha's extension, and the naive append."""
    from transformers import AutoTokenizer

    from warsha.sentencepiece_hf import sp_model_to_hf

    base_proto = sp_bpe.load_proto(Path(str(MISTRAL / "tokenizer.model.v1")))
    train, held = corpus.texts("ar", "train"), corpus.texts("ar", "validation")
    t0 = time.perf_counter()
    target = sp_bpe.train_bpe(train, added, base_proto)
    train_s = time.perf_counter() - t0
    merged = sp_bpe.merge_pieces(base_proto, target, added, family.piece_test("auto", "ar", False))
    kept, _ = sp_bpe.prune_unreached(merged.proto, base_proto, merged.added, merged.scores, train)
    naive = naive_append(base_proto, target)
    dirs = {}
    for name, proto in (("base", base_proto), ("warsha", merged.proto), ("naive", naive)):
        d = tmp / name
        d.mkdir()
        (d / "tokenizer.model").write_bytes(proto.SerializeToString())
        sp_model_to_hf(d / "tokenizer.model", d)
        dirs[name] = AutoTokenizer.from_pretrained(d)
    base = dirs["base"]
    rows = [describe("sentencepiece base (mistral v1)", base, base, corpus, 32000, None)]
    rows.append(
        describe(
            f"sentencepiece + warsha ({len(kept)})",
            dirs["warsha"],
            base,
            corpus,
            32000,
            len(sp_bpe.unreached(merged.proto, 32000, held)),
        )
    )
    rows.append(
        describe(
            "sentencepiece + naive append",
            dirs["naive"],
            base,
            corpus,
            32000,
            len(sp_bpe.unreached(naive, 32000, held)),
        )
    )
    target_only = sp_bpe.processor(target)
    rows.append(
        {
            "tokenizer": f"target-only BPE ({added}, reference)",
            "ar_tokens_per_word": sum(map(len, target_only.encode(held))) / sum(len(t.split()) for t in held),
            "train_seconds": train_s,
        }
    )
    return rows


def naive_append(base: Any, target: Any) -> Any:
    """Peer recipe: every target piece absent from the base, appended with score 0."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    out = pb.ModelProto()
    out.CopyFrom(base)
    have = {p.piece for p in base.pieces}
    for p in target.pieces:
        if p.type == sp_bpe.NORMAL and p.piece not in have:
            new = out.pieces.add()
            new.piece, new.score, new.type = p.piece, 0.0, sp_bpe.NORMAL
            have.add(p.piece)
    return out


def byte_rows(corpus: Any, added: int) -> list[dict[str, Any]]:
    """tekken (byte-level BPE, 131k) before and after Warsha's vocab + merges extension."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = byte_bpe.tiktoken_to_hf(Path(str(MISTRAL / "tekken_240718.json")))
    merges = byte_bpe.train_merges(spec, corpus.texts("ar", "train"), added)
    result = byte_bpe.extend(spec, merges, added, family.piece_test("auto", "ar", False))
    base = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    ext = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(result.spec)))
    from tokenizer_ext.checks import byte_unreached

    n = 131072
    return [
        describe("byte-level base (tekken 240718)", base, base, corpus, n, None),
        describe(
            f"byte-level + warsha ({len(result.added)})",
            ext,
            base,
            corpus,
            n,
            len(byte_unreached(ext, n, corpus.texts("ar", "validation"))),
        ),
    ]


def adaptation(model_dir: Path, corpus: Any, steps: int, added: int, tmp: Path) -> dict[str, Any]:
    """extend -> embed -> adapt (QLoRA) on ``model_dir``, with the same-budget base control."""
    from tokenizer_ext import adapt, embed
    from tokenizer_ext.stages import AdaptParams, EmbedParams, ExtendParams
    from warsha.stage import StageContext
    from warsha.training import TrainParams

    class Tracker:
        def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
            pass

    def ctx(name: str, src: Path) -> StageContext:
        return StageContext(
            stage=name,
            stage_id=name,
            recipe=SimpleNamespace(data=corpus.config, seed=0),
            out_dir=tmp / name,
            inputs={"model": src},
            input_manifests={},
            checkpoint_dir=tmp / f"{name}.ckpt",
            tracker=Tracker(),
            device="cpu",
            seed=0,
            _corpus=corpus,
        )

    out: dict[str, Any] = {}
    c = ctx("extend", model_dir)
    out["extend"] = {
        k: v
        for k, v in extend.run(c, ExtendParams(vocab_size=32000 + added)).items()
        if k in ("added_pieces", "unreachable_added", "fertility")
    }
    e = ctx("embed", c.out_dir)
    out["embed"] = embed.run(e, EmbedParams(eval_docs=64))
    train = TrainParams(
        steps=steps,
        batch_size=8,
        seq_len=256,
        lr=1e-3,
        warmup_steps=max(1, steps // 10),
        checkpoint_every=max(steps, 1),
        log_every=10,
    )
    out["adapt"] = adapt.run(ctx("adapt", e.out_dir), AdaptParams(train=train, eval_docs=64, gen_tokens=64))
    return out


def from_run(run: Path) -> dict[str, Any]:
    """The adaptation figures a pipeline run already measured (manifests of embed and adapt)."""
    out = {}
    for stage in ("extend", "embed", "adapt"):
        manifest = run / stage / "warsha.json"
        if manifest.is_file():
            out[stage] = json.loads(manifest.read_text()).get("metrics", {})
    if "adapt" not in out:
        raise SystemExit(f"{run}: no adapt/warsha.json; run the recipe's tokenizer_ext stages first")
    return out


def adaptation_table(a: dict[str, Any]) -> str:
    """Bits per character: base, extended at init, extended adapted, base adapted (same budget)."""
    rows = [
        ("base model", a["adapt"].get("base_model", {}).get("bits_per_char")),
        ("extended, at init", a.get("embed", {}).get("bits_per_char", {}).get("extended_init")),
        ("extended, adapted", a["adapt"]["extended"].get("bits_per_char")),
        ("base, adapted (same budget)", a["adapt"].get("base_same_budget", {}).get("bits_per_char")),
    ]
    lines = ["model | ar bpc | en bpc"]
    for name, bpc in rows:
        if bpc:
            lines.append(f"{name} | {bpc['ar']:.3f} | {bpc['en']:.3f}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of the tokenizer rows."""
    cols = [
        "tokenizer",
        "vocab",
        "added",
        "ar_tokens_per_word",
        "en_tokens_per_word",
        "ar_chars_per_token",
        "en_unchanged",
        "dead_added",
        "encode_chars_per_s",
    ]
    lines = [" | ".join(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(
                f"{v:,.3f}"
                if isinstance(v, float) and c != "encode_chars_per_s"
                else f"{v:,.0f}"
                if isinstance(v, float)
                else str(v)
            )
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--added", type=int, default=16000, help="pieces to add")
    ap.add_argument("--adapt-model", type=Path, default=None, help="base model dir for the adaptation comparison")
    ap.add_argument("--steps", type=int, default=150, help="adaptation steps (each run)")
    ap.add_argument("--skip-byte", action="store_true", help="skip the tekken rows")
    ap.add_argument("--from-run", type=Path, default=None, help="read adaptation figures from a pipeline run")
    args = ap.parse_args()
    corpus = load_corpus(DataConfig())
    result: dict[str, Any] = {"corpus": corpus.normalisation, "split": "validation"}
    with tempfile.TemporaryDirectory() as tmp:
        rows = sp_rows(corpus, args.added, Path(tmp))
        if not args.skip_byte:
            rows += byte_rows(corpus, args.added)
        result["tokenizers"] = rows
        print(table(rows))
        if args.adapt_model:
            result["adaptation"] = adaptation(args.adapt_model, corpus, args.steps, args.added, Path(tmp))
        elif args.from_run:
            result["adaptation"] = from_run(args.from_run)
        if "adaptation" in result:
            print(adaptation_table(result["adaptation"]))
            print(json.dumps(result["adaptation"]["adapt"].get("targets"), indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "tokenizer_bench.json"
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
