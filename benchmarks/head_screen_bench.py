"""The LM head of a greedy batch: the whole head against serve's batch screen. `python -m benchmarks.head_screen_bench`.

What: a real model (default: the recipe's Gemma 3 270M import, bf16 or `--dtype float32`) generates greedily on a few
Arabic, English and code prompts in serve; the head's input rows are recorded (the screen
calibrates on the first of them, as it does when serving). On the rows after the calibration,
batches of `--rows` rows go through the whole head (oneDNN's bf16 slices into the logits
buffer, or its float32 GEMM: what a batch takes without the screen) and through `serve.head_screen_batch` (uint8 x
int8 products, each row's candidates exact), taking turns; each figure is the median of
`--reps`. The argmax of every row must agree. Prints a table; writes
benchmarks/results/head_screen_bench-<time>.json. State the host's ISA beside the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from serve import LLM, SamplingParams, cpu_kernels
from serve.head import SlicedHead
from serve.sampler import argmax_ids

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = (
    "قال رسول الله صلى الله عليه وسلم إنما الأعمال بالنيات",
    "تقع المدينة على ضفاف النهر، وقد بنيت في العصر الروماني",
    "The history of the city goes back to the Roman period, when a small fort was built",
    "def forward(self, x):\n    return self.linear(x) + self.bias\n",
    "In 1905 Einstein published four papers that changed physics:",
    "وكان الناس في ذلك الزمان يسافرون على الإبل من مكة إلى الشام",
    "Recipe: mix the flour and the water, then knead the dough for ten minutes",
    "السلام عليكم ورحمة الله وبركاته، أما بعد",
)


def record_rows(llm: LLM, tokens: int) -> torch.Tensor:
    """The head's input rows of greedy generation on `PROMPTS` (each prompt twice, at two lengths)."""
    screen = llm.runner.target.screen
    seen: list[torch.Tensor] = []
    inner = screen.screened

    def recording(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        seen.append(x.detach().clone())
        return inner(x, *args, **kwargs)

    screen.screened = recording  # type: ignore[method-assign]
    try:
        llm.generate(list(PROMPTS), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        llm.generate([p + " " + p for p in PROMPTS], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finally:
        screen.screened = inner  # type: ignore[method-assign]
    return torch.cat(seen)


def turns(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall milliseconds of each function, the functions taking turns in each repetition."""
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def whole_head(target: Any, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The whole head as a batch takes it without the screen: oneDNN's bf16 slices into the logits
    buffer, or the float32 linear."""
    return target.head(x, buf) if isinstance(target.head, SlicedHead) else target.head(x).float()


def measure(llm: LLM, rows: torch.Tensor, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per batch size: whole head and batch screen in turns, the candidates, and the argmax check."""
    target = llm.runner.target
    screen, vocab = target.screen, target.lm_head.shape[0]
    held_out = rows[screen.batch.seen :]
    out = []
    for m in sizes:
        x = held_out[-m:].contiguous()
        whole_buf, screen_buf = torch.empty(m, vocab), torch.empty(m, vocab)
        want = whole_head(target, x, whole_buf).argmax(-1)
        calls, found = screen.calls, screen.candidates
        got = screen.screened(x, None, target.screen_rows, screen_buf)
        if got is None:
            raise SystemExit(f"{m} rows: the batch screen did not serve them (flat rows?)")
        per_row = (screen.candidates - found) / max(screen.calls - calls, 1)
        same = bool(torch.equal(argmax_ids(got), want))  # the argmax itself (int64 [rows]) or logits
        ms = turns(
            {
                "whole": partial(whole_head, target, x, whole_buf),
                "screen": partial(screen.screened, x, None, target.screen_rows, screen_buf),
            },
            reps,
        )
        row = {"rows": m, "whole_ms": ms["whole"], "screen_ms": ms["screen"], "speedup": ms["whole"] / ms["screen"]}
        out.append({**row, "candidates_per_row": per_row, "same_argmax": same})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=Path("runs/arabic-gemma3-270m/import"), help="a bf16-servable model dir"
    )
    p.add_argument("--rows", default="12,16,32,64", help="batch sizes (logits rows), comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt while recording rows")
    p.add_argument("--reps", type=int, default=7, help="repetitions per contender (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the served model's dtype")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype)
    screen = llm.runner.target.screen
    if screen is None or screen.batch is None:
        raise SystemExit(
            f"no batch screen here (variant {cpu_kernels.isa()}; it runs on avx512_bf16 with a large bf16 head)"
        )
    rows = record_rows(llm, args.tokens)
    sizes = [int(s) for s in args.rows.split(",")]
    if not screen.batch.ready or rows.shape[0] - screen.batch.seen < max(sizes):
        raise SystemExit(f"{rows.shape[0]} rows recorded: too few past the calibration; raise --tokens")
    results = measure(llm, rows, sizes, args.reps)
    where = f"{args.model} {args.dtype}, variant {cpu_kernels.isa()}, {args.threads} threads"
    print(f"{where}, {rows.shape[0]} rows recorded")
    print(f"{'rows':>5} {'whole ms':>9} {'screen ms':>10} {'speedup':>8} {'cand/row':>9} same argmax")
    for r in results:
        print(
            f"{r['rows']:>5} {r['whole_ms']:>9.2f} {r['screen_ms']:>10.2f} {r['speedup']:>7.2f}x "
            f"{r['candidates_per_row']:>9.1f} {r['same_argmax']}"
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"head_screen_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"model": str(args.model), "dtype": args.dtype, "isa": cpu_kernels.isa(), "threads": args.threads}
    meta["recorded_rows"] = rows.shape[0]
    path.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
