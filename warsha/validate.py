"""Stage ``serve.validate``: drive the bundled engine with the pipeline's target and draft.

The one place where the core imports ``serve`` (serve never imports the core). It runs a fixed
workload of held-out target-language prompts through the engine without and with the draft,
at each configured batch size, and records acceptance rate, mean accepted length, TTFT, TPOT,
throughput, and whether speculative greedy output is token-identical to the target alone,
which is the property that makes speculation safe to switch on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from warsha.schema import check, ge
from warsha.stage import StageContext, StageDef


@dataclass
class ValidateParams:
    """The fixed workload and engine settings."""

    num_prompts: int = field(default=16, metadata=check(ge(1)))
    prompt_tokens: int = field(default=32, metadata=check(ge(1), help="prompt length cut from held-out text"))
    max_tokens: int = field(default=64, metadata=check(ge(1)))
    num_speculative_tokens: int = field(default=4, metadata=check(ge(1)))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    dtype: Literal["bfloat16", "float32"] = field(
        default="float32", metadata=check(help="float32 makes the greedy equality check exact; bf16 can flip near-ties"))
    kv_cache_memory_gb: float = field(default=0.5, metadata=check(help="KV pool size per engine"))

    def validate(self) -> list[str]:
        """Batch sizes must be positive."""
        return [f"batch_sizes[{i}]: must be >= 1, got {b}" for i, b in enumerate(self.batch_sizes) if b < 1]


def workload(ctx: StageContext, p: ValidateParams) -> list[list[int]]:
    """The first ``prompt_tokens`` ids of held-out target-language documents (BOS first)."""
    from transformers import AutoTokenizer

    corpus = ctx.corpus()
    tok = AutoTokenizer.from_pretrained(ctx.model_dir)
    texts = [t for t in corpus.texts(corpus.config.target_lang, "validation") if len(t.split()) >= p.prompt_tokens]
    if len(texts) < p.num_prompts:
        raise ValueError(f"serve.validate: only {len(texts)} held-out documents are long enough; lower num_prompts")
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return [(bos + ids)[: p.prompt_tokens] for ids in tok(texts[: p.num_prompts], add_special_tokens=False).input_ids]


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy generation of every prompt; outputs and the engine's statistics."""
    from serve.sampler import SamplingParams
    from serve.stats import EngineStats

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], params)  # warm-up: first calls pay one-time allocation costs
    engine.stats = EngineStats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    stats = engine.stats.summary()
    stats["ttft_s"] = list(engine.stats.ttft)  # per request, for the report's distributions
    stats["tpot_s"] = list(engine.stats.tpot)
    stats["wall_s"] = wall
    stats["output_tokens_per_s"] = sum(len(o.token_ids) for o in outs) / wall
    return [o.token_ids for o in outs], stats


def run(ctx: StageContext, p: ValidateParams) -> dict[str, Any]:
    """Plain vs speculative at each batch size; equality of greedy outputs."""
    from serve.engine import LLM

    prompts = workload(ctx, p)
    metrics: dict[str, Any] = {"num_prompts": len(prompts), "prompt_tokens": p.prompt_tokens,
                               "max_tokens": p.max_tokens, "k": p.num_speculative_tokens}
    all_match = True
    for bs in p.batch_sizes:
        common = {"dtype": p.dtype, "max_num_seqs": bs, "kv_cache_memory_gb": p.kv_cache_memory_gb}
        plain_out, plain = run_engine(LLM(ctx.model_dir, **common), prompts, p.max_tokens)
        spec_engine = LLM(ctx.model_dir, ctx.inputs["draft"], num_speculative_tokens=p.num_speculative_tokens,
                          adaptive_speculation=False, **common)
        spec_out, spec = run_engine(spec_engine, prompts, p.max_tokens)
        mismatched = sum(a != b for a, b in zip(plain_out, spec_out))
        all_match &= mismatched == 0
        metrics[f"batch{bs}"] = {
            "plain": plain,
            "speculative": spec,
            "speedup": spec["output_tokens_per_s"] / plain["output_tokens_per_s"],
            "mismatched_requests": mismatched,
        }
        ctx.log.info("serve.validate batch %d: acceptance %.3f, speedup %.2fx, %d mismatched", bs,
                     spec["acceptance_rate"] or 0.0, metrics[f"batch{bs}"]["speedup"], mismatched)
    metrics["outputs_match"] = all_match
    if ctx.is_main:
        _write_summary(ctx, metrics)
    return metrics


def _write_summary(ctx: StageContext, metrics: dict[str, Any]) -> None:
    """A small readable record in the artifact (the manifest holds the full numbers)."""
    lines = ["| batch | acceptance | mean accepted length | TTFT p50 (s) | TPOT p50 (s) | tok/s plain | tok/s spec | speedup | match |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, m in metrics.items():
        if key.startswith("batch") and isinstance(m, dict):
            s, q = m["speculative"], m["plain"]
            lines.append(f"| {key[5:]} | {s['acceptance_rate'] or 0:.3f} | {s['mean_accepted_length'] or 0:.2f} | "
                         f"{s['ttft_p50'] or 0:.4f} | {s['tpot_p50'] or 0:.4f} | {q['output_tokens_per_s']:.1f} | "
                         f"{s['output_tokens_per_s']:.1f} | {m['speedup']:.2f} | {m['mismatched_requests'] == 0} |")
    (ctx.out_dir / "serve_validate.md").write_text("\n".join(lines) + "\n")


STAGE = StageDef(
    name="serve.validate",
    params=ValidateParams,
    run=run,
    description="serve target and draft with the bundled engine: acceptance, TTFT, TPOT, output equality",
    inputs=("model", "draft"),
)
