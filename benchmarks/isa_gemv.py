"""serve's small-batch products per ISA variant against oneDNN: `python -m benchmarks.isa_gemv`.

What: the bf16 linears of a decode step (Gemma 3 270M's shapes by default: q|k|v, o, gate|up,
down and the 262k-row LM head) at 1-8 activation rows, timed for torch's oneDNN-prepacked bf16
linear (what serve runs on a native-bf16 CPU without its kernels) and for serve's `gemv_bf16`
in each ISA variant this CPU runs, plus the int4 x int8 kernel (`gemv_int4_a8`) on the same
shapes. The contenders take turns inside each repetition (the host may be shared), and each
figure is the median of `--reps`. Prints a table; writes benchmarks/results/isa_gemv-<time>.json.

`--gemm`: the step's four linears over 18 layers of distinct weights (read from DRAM, as in
serving; Gemma 3 270M's shapes) at 5-256 rows, wall clock on `--threads` (default 2), serve's
small-batch GEMM (`gemm_bf16_rows`) against oneDNN's prepacked GEMM and, on the amx variant,
serve's AMX tile GEMM, taking turns: where `serve.quant.NATIVE_BF16_GEMM_MAX_ROWS` comes from.

Clock: `--clock cpu` (the default) times one thread's CPU time (`time.thread_time`, torch on one
thread so every kernel runs on the calling thread): on a host shared with other work, wall time
measures the scheduler as much as the kernel, while CPU time only counts the cycles the kernel
ran (memory stalls included). `--clock wall --threads N` gives the usual wall-clock figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from serve import cpu_kernels
from serve.quant import BF16_PACK_BATCH_HINT, _mkldnn_pack

RESULTS = Path(__file__).resolve().parent / "results"
# (name, out_features, in_features) of Gemma 3 270M's decode-step products
GEMMA3_270M = (("qkv", 1536, 640), ("o", 640, 1024), ("gate_up", 4096, 640), ("down", 640, 2048), ("head", 262144, 640))


def timed(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    """Seconds per call of `fn` over `calls` calls (after one warm-up call), on `clock`."""
    fn()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def contenders(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each way to compute x @ w.T here: oneDNN, then serve's kernel per variant (bf16 and int4 x int8)."""
    packed = _mkldnn_pack(w)
    out: dict[str, Callable[[], object]] = {}
    if packed is not None:
        out["onednn bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    g = 128 if w.shape[1] % 128 == 0 else 32
    q = torch.randint(0, 16, (w.shape[1], w.shape[0]), dtype=torch.int32)
    int4 = cpu_kernels.Int4Packed(
        q, torch.rand(w.shape[1] // g, w.shape[0]) * 0.01, torch.zeros(w.shape[1] // g, w.shape[0]), g
    )
    for isa in cpu_kernels.supported_isas():
        out[f"serve bf16 {isa}"] = _in_isa(isa, lambda: cpu_kernels.gemv_bf16(x, w))
        out[f"serve int4xint8 {isa}"] = _in_isa(isa, lambda: cpu_kernels.gemv_int4(x, int4, int8_activations=True))
    return out


def _in_isa(isa: str, fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        with cpu_kernels.use_isa(isa):
            return fn()

    return call


def layer_step(rows: int, layers: int, reps: int) -> dict[str, float]:
    """ms for `rows` activation rows through every layer's four linears, each contender in turn.

    oneDNN's prepacked GEMM, serve's small-batch GEMM and, where the CPU runs the amx variant,
    serve's AMX tile GEMM on its tile-ordered copy: the three ways a 5-256-row bf16 batch can go.
    """
    ws = [[torch.randn(n, k).bfloat16() * 0.02 for _ in range(layers)] for _, n, k in GEMMA3_270M[:4]]
    xs = [torch.randn(rows, k).bfloat16() for _, _, k in GEMMA3_270M[:4]]
    pairs = [(x, w) for x, wl in zip(xs, ws) for w in wl]
    packed = [_mkldnn_pack(w, batch_hint=BF16_PACK_BATCH_HINT) for _, w in pairs]
    mkldnn = torch.ops.mkldnn._linear_pointwise
    fns: dict[str, Callable[[], object]] = {
        "onednn bf16": lambda: [mkldnn(x, p, None, "none", [], "") for (x, _), p in zip(pairs, packed)],
        "serve gemm_bf16_rows": lambda: [cpu_kernels.gemm_bf16_rows(x, w) for x, w in pairs],
    }
    if cpu_kernels.has_amx():
        tiles = [cpu_kernels.amx_pack(w) for _, w in pairs]
        fns["serve amx_linear"] = lambda: [cpu_kernels.amx_linear(x, t) for (x, _), t in zip(pairs, tiles)]
    times: dict[str, list[float]] = {c: [] for c in fns}
    for _ in range(reps):
        for c, fn in fns.items():
            times[c].append(timed(fn, 1, time.perf_counter))
    return {c: statistics.median(ts) * 1e3 for c, ts in times.items()}


def gemm_table(rows: list[int], threads: int, reps: int) -> list[dict[str, object]]:
    """`--gemm`: the layer step at each row count, printed as it goes."""
    torch.set_num_threads(threads)
    table: list[dict[str, object]] = []
    for m in rows:
        ms = layer_step(m, 18, reps)
        ratio = ms["onednn bf16"] / ms["serve gemm_bf16_rows"]
        print(
            f"rows {m:4d}  " + "  ".join(f"{c} {v:7.2f} ms" for c, v in ms.items()) + f"  onednn/serve {ratio:.3f}",
            flush=True,
        )
        table += [{"rows": m, "kernel": c, "ms": v, "layers": 18} for c, v in ms.items()]
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1; 2 with --gemm)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--skip-head", action="store_true", help="leave out the 262k-row head (slow to time)")
    p.add_argument("--gemm", action="store_true", help="18 layers' linears at --rows (default 5-256) from DRAM")
    args = p.parse_args(argv)
    if not cpu_kernels.available():
        p.error("serve's CPU kernels are not available here (see the log line above)")
    if args.gemm:
        if not cpu_kernels.has_bf16_dot():
            p.error(f"--gemm times serve's bf16 GEMMs (avx512_bf16, amx); this CPU runs {cpu_kernels.isa()}")
        rows = [int(r) for r in args.rows.split(",")] if args.rows != "1,2,4,8" else [5, 8, 16, 33, 64, 128, 256]
        threads = args.threads or 2
        return _write(
            {"mode": "gemm", "threads": threads, "torch": torch.__version__}, gemm_table(rows, threads, args.reps)
        )
    args.threads = args.threads or 1
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu times one thread: use --threads 1 (or --clock wall)")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shapes = [s for s in GEMMA3_270M if not (args.skip_head and s[0] == "head")]
    rows = [int(r) for r in args.rows.split(",")]
    table: list[dict[str, object]] = []
    for name, n, k in shapes:
        w = torch.randn(n, k).bfloat16()
        calls = max(2, int(2e8 // (n * k)))
        for m in rows:
            fns = contenders(w, torch.randn(m, k).bfloat16())
            times: dict[str, list[float]] = {c: [] for c in fns}
            for _ in range(args.reps):
                for c, fn in fns.items():  # contenders take turns
                    times[c].append(timed(fn, calls, clock))
            for c, ts in times.items():
                med = statistics.median(ts)
                table.append({"shape": name, "n": n, "k": k, "rows": m, "kernel": c, "ms": med * 1e3})
                gbs = n * k * (0.5 if "int4" in c else 2) / med / 1e9
                print(
                    f"{name:8s} {n:6d}x{k:<5d} rows {m}  {c:26s} {med * 1e3:8.3f} ms  {gbs:6.1f} GB/s weights",
                    flush=True,
                )
    meta = {
        "clock": args.clock,
        "threads": args.threads,
        "isas": cpu_kernels.supported_isas(),
        "torch": torch.__version__,
    }
    return _write(meta, table)


def _write(meta: dict[str, object], table: list[dict[str, object]]) -> int:
    """benchmarks/results/isa_gemv-<time>.json with the run's settings and rows."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"isa_gemv-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**meta, "isa": cpu_kernels.isa(), "rows": table}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
