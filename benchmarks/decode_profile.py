"""Where a batch-1 decode step of Warsha's engine spends its time, against the bandwidth roofline.

Wraps the engine's parts with wall-clock timers (no change to serve/): per step the scheduler,
the model forward, the sampler and the commit; inside the forward the fused linears (q|k|v, o,
gate|up, down), attention, the KV write, RMSNorm, RoPE (or the fused RoPE + KV write call), the
LM head and the metadata; what the timers do not cover is Python between the calls. The linears'
time is also set against the bytes they read at the measured read bandwidth (a 1 GiB float32
sum), so each part shows how far it is from memory speed.

    .venv/bin/python -m benchmarks.decode_profile --preset large --threads 2
    .venv/bin/python -m benchmarks.decode_profile --preset large --int4   # GPTQ RTN g128, int8 act
    .venv/bin/python -m benchmarks.decode_profile --model runs/arabic-gemma3-270m/import \
        --int4-model runs/arabic-gemma3-270m/q4      # a real checkpoint (and its GPTQ int4 one) instead
    .venv/bin/python -m benchmarks.decode_profile --model runs/arabic-gemma3-270m/yarn --mixed 64

`--mixed N` profiles serve_peers' mixed workload instead (the first N of its 64 requests: prompts
16-512, outputs 16-256, greedy, all submitted at once): the same parts summed over every step
(prefill chunks beside decodes), attention split into serve's paged-attention kernel (decode
rows, and prefill chunks too on CPUs with bf16 dot products) and torch's path, per step and in
seconds over the run.

Prints a table; writes benchmarks/results/decode_profile-<time>.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import serve.model as sm
from benchmarks import serve_bench as sb
from serve import LLM, SamplingParams, hugepages
from serve import roofline as rl


class Timers:
    """Accumulated seconds and call counts per name; `wrap` times any callable under a name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(llm: LLM, t: Timers) -> None:
    """Replace the engine's parts by timed wrappers (this process only)."""
    model, runner = llm.runner.target, llm.runner
    for layer in model.layers:
        for part in ("qkv", "o", "gate_up", "down"):
            setattr(layer, part, t.wrap(f"linear {part}", getattr(layer, part)))
    model.head = t.wrap("lm head", model.head)
    if model.screen is not None:  # greedy rows find their token through the screen instead (serve.head_screen)
        model.screen.screened = t.wrap("lm head", model.screen.screened)  # type: ignore[method-assign]
    backend = model.backend
    backend.forward = t.wrap("attention", backend.forward)
    backend.build_metadata = t.wrap("metadata", backend.build_metadata)
    backend.slot_mapping = t.wrap("metadata", backend.slot_mapping)
    runner.target_kv.write = t.wrap("kv write", runner.target_kv.write)
    model.rope.lookup = t.wrap("rope", model.rope.lookup)
    sm.rms_norm = t.wrap("rms norm", sm.rms_norm)
    sm.apply_rope = t.wrap("rope", sm.apply_rope)
    sm.cpu_kernels.rope_write_kv = t.wrap("rope + kv write", sm.cpu_kernels.rope_write_kv)  # the fused CPU call
    model.forward = t.wrap("forward", model.forward)
    llm.scheduler.schedule = t.wrap("schedule", llm.scheduler.schedule)
    llm.sampler = t.wrap("sampler", llm.sampler)
    llm._commit = t.wrap("commit", llm._commit)  # type: ignore[method-assign]
    llm.step = t.wrap("step", llm.step)  # type: ignore[method-assign]


def instrument_attention_split(llm: LLM, t: Timers) -> None:
    """Time serve's paged-attention kernel on its own; the rest of "attention" is torch's path."""
    import serve.attention.torch_ref as tr

    tr.cpu_kernels.paged_attention = t.wrap("attention: serve kernel", tr.cpu_kernels.paged_attention)


def linear_bytes(llm: LLM) -> dict[str, int]:
    """Bytes each fused linear kind reads per step over all layers (the weights the kernel reads)."""
    out: dict[str, int] = defaultdict(int)
    for layer in llm.runner.target.layers:
        for part in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, part)
            out[f"linear {part}"] += _read_bytes(lin)
    out["lm head"] = head_bytes(llm.runner.target)
    return dict(out)


def head_bytes(target: Any) -> int:
    """Bytes a greedy decode row reads from the LM head: the int8 rows and their scales where an
    int8 head (`head_quant="int8"`) or the int8 screen (`serve.head_screen`, a large bf16 or
    float32 head) serves it, else the head's own weight. Counting the bf16 weight for a screened
    head showed it at twice the host's bandwidth."""
    int8 = target.screen if getattr(target, "screen", None) is not None else target.head
    parts = [int8.q, int8.scale] if hasattr(int8, "q") else [target.lm_head]
    return sum(t.numel() * t.element_size() for t in parts)


def _read_bytes(lin: Any) -> int:
    """Bytes of the tensors a decode row reads from one linear (the bf16 weight, or the int4 parts)."""
    if hasattr(lin, "weight") and isinstance(lin.weight, torch.Tensor):
        return lin.weight.numel() * lin.weight.element_size()
    packed = getattr(lin, "avx2", None)  # an int4 linear on serve's kernels: their layout's tensors
    if packed is not None:
        return sum(t.numel() * t.element_size() for t in (packed.q, packed.scales, packed.zeros))
    seen, total = set(), 0
    for v in vars(lin).values():
        for t in v if isinstance(v, list | tuple) else [v]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def profile(model_dir: Path, args: argparse.Namespace, bw: float, **engine: Any) -> dict[str, Any]:
    """Decode `--new-tokens` at batch 1 after a `--prompt-len` prompt; the per-part seconds per step."""
    llm = LLM(model_dir, **engine)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    lb = linear_bytes(llm)  # before the wrappers replace the linears
    t = Timers()
    instrument(llm, t)
    prompt = sb.workload(1, (args.prompt_len, args.prompt_len), (1, 1), llm.config.vocab_size, seed=2)[0][0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params)  # prefill of this prompt once, outside the counts
    t.reset()
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens + 1, ignore_eos=True))
    llm.step()  # the prefill step
    t.reset()
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
    wall = time.perf_counter() - start
    steps = t.calls["step"]
    per = {k: v / steps for k, v in t.seconds.items()}
    _derived_parts(per)
    bound = {k: b / bw for k, b in lb.items()}
    return {"steps": steps, "tok_per_s": steps / wall, "per_step_s": per, "bytes": lb, "bound_s": bound}


def profile_mixed(model_dir: Path, args: argparse.Namespace, bw: float, **engine: Any) -> dict[str, Any]:
    """serve_peers' mixed workload (first `--mixed` requests); the per-part seconds per step and in total."""
    llm = LLM(model_dir, kv_cache_memory_gb=args.kv_cache_gb, **engine)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    lb = linear_bytes(llm)
    t = Timers()
    instrument(llm, t)
    instrument_attention_split(llm, t)
    reqs = sb.workload(64, (16, 512), (16, 256), llm.config.vocab_size, seed=0)[: args.mixed]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t.reset()
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    wall = time.perf_counter() - start
    steps = t.calls["step"]
    per = {k: v / steps for k, v in t.seconds.items()}
    _derived_parts(per)
    per["attention: torch path"] = per.get("attention", 0.0) - per.get("attention: serve kernel", 0.0)
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "steps": steps,
        "tok_per_s": tokens / wall,
        "tokens": tokens,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "wall_s": wall,
        "per_step_s": per,
        "bytes": lb,
        "bound_s": {k: b / bw for k, b in lb.items()},
    }


def _derived_parts(per: dict[str, float]) -> None:
    """Add the untimed remainders: python and small ops inside the forward, engine python around it."""
    inner = ("linear qkv", "linear o", "linear gate_up", "linear down", "lm head", "attention", "kv write")
    inner += ("rms norm", "rope", "rope + kv write", "metadata")
    per["forward: python and small ops"] = per["forward"] - sum(per.get(k, 0.0) for k in inner)
    per["step: engine python"] = per["step"] - sum(
        per.get(k, 0.0) for k in ("forward", "schedule", "sampler", "commit")
    )


def print_profile(name: str, r: dict[str, Any]) -> None:
    per, bound = r["per_step_s"], r["bound_s"]
    total = per["step"]
    print(f"\n== {name}: {r['tok_per_s']:.2f} tok/s, {total * 1e3:.1f} ms/step over {r['steps']} steps")
    print(f"{'part':40} {'ms/step':>8} {'share':>6} {'MB read':>8} {'at BW ms':>8} {'of BW':>6}")
    order = ["linear qkv", "linear o", "linear gate_up", "linear down", "lm head", "attention"]
    order += ["attention: serve kernel", "attention: torch path", "kv write"]
    order += ["rms norm", "rope", "rope + kv write", "metadata", "forward: python and small ops"]
    order += ["sampler", "schedule", "commit"]
    order += ["step: engine python"]
    for k in order:
        if k not in per:
            continue
        v = per[k]
        extra = ""
        if k in bound:
            extra = f" {r['bytes'][k] / 1e6:8.1f} {bound[k] * 1e3:8.2f} {bound[k] / v:6.0%}" if v else ""
        print(f"{k:40} {v * 1e3:8.2f} {v / total:6.1%}{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="large", help="serve_bench preset")
    p.add_argument("--int4", action="store_true", help="also profile the GPTQ RTN g128 int4 checkpoint (int8 act)")
    p.add_argument("--model", type=Path, help="profile this HF checkpoint (served in bf16) instead of a preset")
    p.add_argument("--int4-model", type=Path, help="with --model: also this GPTQ int4 checkpoint (int8 act)")
    p.add_argument("--head-quant", default="none", help="LM head format: none or int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mixed", type=int, default=0, help="profile the first N requests of the mixed workload instead")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV cache of the --mixed engine")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "warsha-serve-bench")
    args = p.parse_args(argv)
    if args.preset not in sb.PRESETS:
        p.error(f"--preset: unknown {args.preset!r}; known: {', '.join(sb.PRESETS)}")
    torch.set_num_threads(args.threads)
    bw = rl.read_bandwidth(args.threads)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s at {args.threads} threads")
    name = str(args.model) if args.model else args.preset
    d = args.model or sb.build_random_model(args.workdir / args.preset, args.preset)
    results: dict[str, Any] = {"bandwidth_gb_s": bw / 1e9, "threads": args.threads, "preset": name, "runs": {}}
    results["isa"], results["row_order"] = sm.cpu_kernels.isa(), sm.cpu_kernels.row_order()
    results["huge_pages"], results["thp"] = hugepages.enabled(), hugepages.thp_mode()
    print(f"serve CPU kernels: {results['isa']} variant, one-row products {results['row_order']}")
    print(f"weights and KV cache on huge pages: {results['huge_pages']} (THP {results['thp']})")
    if args.mixed:
        results["runs"]["mixed bf16"] = r = profile_mixed(d, args, bw, dtype="bfloat16", head_quant=args.head_quant)
        print_profile(f"{name} bf16, {args.mixed} mixed requests ({r['tokens']} tokens, {r['wall_s']:.1f} s)", r)
        sb.write_results("decode_profile", results)
        return 0
    results["runs"]["bf16"] = profile(d, args, bw, head_quant=args.head_quant)
    print_profile(f"{name} bf16", results["runs"]["bf16"])
    q = args.int4_model if args.model else None
    if args.int4 and not args.model:
        q = sb.quantize_rtn_gptq(d, d.parent / (d.name + "-gptq"))
    if q is not None:
        results["runs"]["int4"] = profile(q, args, bw, int4_activations="int8", head_quant=args.head_quant)
        print_profile(f"{q} int4 (int8 act)", results["runs"]["int4"])
    sb.write_results("decode_profile", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
