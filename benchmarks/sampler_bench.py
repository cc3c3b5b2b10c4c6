"""Top-k / top-p over a large vocabulary: serve's candidate ranking against a full sort.

`python -m benchmarks.sampler_bench [--model DIR] [--rows 1 8] [--reps 5]`

What: the time serve's `Sampler` takes per step for sampled rows with a nucleus (top-p) or a
top-k, computed two ways on the same logits: `candidates` (serve: rank each row's best 1,024
tokens with `topk`, widen 16-fold only for rows whose nucleus reaches past them) and `full
sort` (every row sorted in full, what serve did before and what vLLM's CPU sampler does with
`torch.sort`). Logits are the model's own at the last positions of a fixed Arabic and English
text (`--model`, a serve checkpoint; its tokenizer), else Zipf-shaped synthetic rows over 262k
tokens. The contenders take turns in each repetition; figures are medians, wall clock, this
process's torch threads. Prints a table; writes benchmarks/results/sampler_bench-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from serve import cpu_kernels, sampler
from serve.sampler import Sampler, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = (
    "قال رسول الله صلى الله عليه وسلم إنما الأعمال بالنيات وإنما لكل امرئ ما نوى. "
    "The committee met on Tuesday to review the budget, and its members agreed to publish the report."
)
SETTINGS = {
    "T=0.8, top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "T=1.0, top_p=0.95": dict(temperature=1.0, top_p=0.95),
    "T=0.7, top_k=40": dict(temperature=0.7, top_k=40),
}


def model_logits(model_dir: Path, rows: int) -> torch.Tensor:
    """float32 logits of the model's last `rows` positions over `TEXT`."""
    from serve.model import DecoderModel
    from serve.tokenizer import Tokenizer

    ids = Tokenizer(model_dir).encode(TEXT)
    model = DecoderModel.load(model_dir, torch.bfloat16)
    return model.prefill_logits(ids)[-rows:].contiguous()


def zipf_logits(rows: int, vocab: int = 262144, seed: int = 0) -> torch.Tensor:
    """Rows whose sorted probabilities fall like rank^-1.1, in a random token order per row."""
    gen = torch.Generator().manual_seed(seed)
    ranked = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    return torch.stack([ranked[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def contenders(logits: torch.Tensor, params: SamplingParams) -> dict[str, Callable[[], object]]:
    """The sampler as serve runs it, and with its candidate width set to the whole vocabulary."""
    rows, vocab = logits.shape
    s = Sampler(0)
    args = (logits, [params] * rows, [[1]] * rows, [[]] * rows, [None] * rows)

    def with_width(width: int) -> Callable[[], object]:
        def run() -> object:
            saved, sampler.CANDIDATES = sampler.CANDIDATES, width
            try:
                return s(*args)
            finally:
                sampler.CANDIDATES = saved

        return run

    return {"candidates": with_width(sampler.CANDIDATES), "full sort": with_width(vocab)}


def measure(logits: torch.Tensor, row_counts: list[int], reps: int) -> list[dict[str, object]]:
    """Median ms per sampler call for each setting, row count and contender, in turns."""
    out = []
    for name, kw in SETTINGS.items():
        for rows in row_counts:
            runs = contenders(logits[:rows].clone(), SamplingParams(**kw))
            times: dict[str, list[float]] = {k: [] for k in runs}
            for fn in runs.values():
                fn()  # warm-up
            for _ in range(reps):
                for label, fn in runs.items():
                    start = time.perf_counter()
                    fn()
                    times[label].append((time.perf_counter() - start) * 1e3)
            med = {k: round(statistics.median(v), 2) for k, v in times.items()}
            out.append({"setting": name, "rows": rows, **{f"{k} ms": v for k, v in med.items()},
                        "speedup": round(med["full sort"] / med["candidates"], 2)})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a serve checkpoint whose logits to sample (default: Zipf rows)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="sampled rows per step")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per contender (median reported)")
    args = parser.parse_args()
    most = max(args.rows)
    logits = model_logits(args.model, most) if args.model else zipf_logits(most)
    table = measure(logits, args.rows, args.reps)
    print(f"{'setting':<20} {'rows':>4} {'candidates ms':>14} {'full sort ms':>13} {'speedup':>8}")
    for r in table:
        print(f"{r['setting']:<20} {r['rows']:>4} {r['candidates ms']:>14} {r['full sort ms']:>13} {r['speedup']:>7}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"sampler_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"model": str(args.model) if args.model else "zipf", "vocab": logits.shape[1],
            "isa": (cpu_kernels.supported_isas() or ("none",))[-1], "machine": platform.machine(),
            "threads": torch.get_num_threads()}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
