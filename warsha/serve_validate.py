"""Stage ``serve.validate``: drive the bundled engine with the pipeline's target and draft.

Where the core drives the engine (serve never imports the core). It runs a fixed
workload of held-out target-language prompts through the engine without and with the draft,
at each configured batch size, and records acceptance rate, mean accepted length, TTFT, TPOT,
throughput, and whether speculative greedy output is token-identical to the target alone,
which is the property that makes speculation safe to switch on.

Verification runs k + 1 rows through the target where plain decoding runs one, and float
kernels sum in a different order for different row counts, so where the target's two best
tokens are within rounding of each other the two runs may pick different ones and diverge from
there. Every divergence is therefore classified at its first differing token: the target's own
top-2 log-probabilities at that prefix are read back from the engine, and a divergence between
exactly those two tokens with a gap under ``tie_tolerance`` is a near-tie flip; anything else is
a real mismatch, and ``outputs_match`` is false only for those. The default tolerance (0.01
nats) is set by int4 checkpoints served with int8 activations: rounding each activation to 8
bits turns the last-bit differences of a float op into whole quantization steps whenever a
value sits near a rounding boundary (docs/precision.md gives the measured gaps).
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warsha.schema import check, convert, ge
from warsha.stage import StageContext, StageDef

if TYPE_CHECKING:
    from serve.args import EngineArgs


# serve.validate's own engine defaults, where they differ from EngineArgs' (what a server gets):
ENGINE_DEFAULTS: dict[str, Any] = {
    # float32 makes the greedy equality check exact; bf16 can flip near-ties
    "dtype": "float32",
    # float makes the greedy check exact for int4 targets; int8 rounds each row's activations, so
    # float noise between a decode step and a verification chunk can flip a rounding and part the
    # outputs (docs/precision.md)
    "int4_activations": "float",
    # two to four engines share this process (plain, speculative, draft alone, lookup alone): a smaller pool each
    "kv_cache_memory_gb": 0.5,
}
SET_BY_STAGE = ("max_num_seqs",)  # each entry of batch_sizes
ALONE = ("draft", "lookup")  # beside prompt lookup: each proposer measured alone too, in this engine order


@dataclass
class ValidateParams:
    """The fixed workload and the engine's options.

    ``engine`` holds any `serve.args.EngineArgs` option, passed to every engine the stage starts
    (`ENGINE_DEFAULTS` where it differs from a server's defaults; ``max_num_seqs`` follows
    ``batch_sizes``). With ``prompt_lookup_max`` > 0 the speculative engine also drafts by prompt
    lookup, and the draft alone and the lookup alone are measured too, so the report shows what
    each proposer buys (on the real recipe's Zen 4 runs the lookup alone beat both together).
    """

    num_prompts: int = field(default=16, metadata=check(ge(1)))
    prompt_tokens: int = field(default=32, metadata=check(ge(1), help="prompt length cut from held-out text"))
    max_tokens: int = field(default=64, metadata=check(ge(1)))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    engine: dict[str, Any] = field(
        default_factory=dict,
        metadata=check(help="EngineArgs options of every engine (`python -m serve --help` lists them)"),
    )
    tie_tolerance: float = field(
        default=1e-2,
        metadata=check(
            ge(0.0), help="a divergence between the target's two best tokens closer than this (nats) is a near-tie flip"
        ),
    )

    def validate(self) -> list[str]:
        """Batch sizes must be positive; the engine block must make a valid EngineArgs."""
        out = [f"batch_sizes[{i}]: must be >= 1, got {b}" for i, b in enumerate(self.batch_sizes) if b < 1]
        return out + engine_problems(self.engine)

    def engine_args(self, batch_size: int = 1, **override: Any) -> "EngineArgs":
        """The engine's options at ``batch_size``: the stage's defaults, the recipe's block, ``override``."""
        from serve.args import EngineArgs

        return EngineArgs(**{**ENGINE_DEFAULTS, **self.engine, "max_num_seqs": batch_size, **override})


def engine_problems(engine: dict[str, Any]) -> list[str]:
    """Each problem of an ``engine:`` block, named by its key: unknown, wrong type, or invalid."""
    from serve.args import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    problems: list[str] = []
    for key, value in engine.items():
        if key in SET_BY_STAGE:
            problems.append(f"engine.{key}: set by batch_sizes; remove it")
        elif key not in hints:
            problems.append(f"engine.{key}: not an engine option (known: {', '.join(sorted(hints))})")
        else:
            convert(hints[key], value, f"engine.{key}", problems)
    if not problems:
        try:
            EngineArgs(**{**ENGINE_DEFAULTS, **engine})
        except ValueError as exc:
            problems.extend(f"engine: {p}" for p in str(exc).split("; "))
    return problems


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


def run_interleaved(
    engines: list[Any], prompts: list[list[int]], batch_size: int, max_tokens: int
) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """Greedy outputs and statistics of each engine over the same prompts, taken in turns.

    A shared host's speed drifts and jumps while a stage runs; engines timed one after the
    other would carry that into their ratio. So the engines take turns, in alternating order
    (ABBA): at batch size 1 prompt by prompt; at larger batch sizes over two passes of the whole
    workload, since cutting it into batch-sized chunks would stop the engine refilling the
    slots of requests that finish early, which is what continuous batching is for.
    """
    from serve.sampler import SamplingParams
    from serve.stats import EngineStats

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for engine in engines:
        engine.generate(prompts[:1], params)  # warm-up: first calls pay one-time allocation costs
        engine.stats = EngineStats()
    every = list(range(len(prompts)))
    chunks = [[i] for i in every] if batch_size == 1 else [every, every]
    outputs: list[dict[int, list[int]]] = [{} for _ in engines]
    walls, tokens = [0.0] * len(engines), [0] * len(engines)
    for n, chunk in enumerate(chunks):
        order = list(range(len(engines)))
        for e in order if n % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            outs = engines[e].generate([prompts[i] for i in chunk], params)
            walls[e] += time.perf_counter() - t0
            tokens[e] += sum(len(o.token_ids) for o in outs)
            for i, o in zip(chunk, outs):
                outputs[e].setdefault(i, o.token_ids)
    stats = [_stats(engine, wall, n) for engine, wall, n in zip(engines, walls, tokens)]
    return [[out[i] for i in every] for out in outputs], stats


def _stats(engine: Any, wall: float, tokens: int) -> dict[str, Any]:
    """The engine's summary plus per-request TTFT/TPOT and throughput over its timed runs."""
    stats = engine.stats.summary()
    stats["ttft_s"] = list(engine.stats.ttft)  # per request, for the report's distributions
    stats["tpot_s"] = list(engine.stats.tpot)
    stats["wall_s"] = wall
    stats["output_tokens_per_s"] = tokens / wall
    return stats


def run(ctx: StageContext, p: ValidateParams) -> dict[str, Any]:
    """Plain vs speculative at each batch size; equality of greedy outputs."""
    prompts = workload(ctx, p)
    engine = p.engine_args()
    metrics: dict[str, Any] = {
        "num_prompts": len(prompts),
        "prompt_tokens": p.prompt_tokens,
        "max_tokens": p.max_tokens,
        "k": engine.num_speculative_tokens,
        "adaptive_speculation": engine.adaptive_speculation,
        "int4_activations": engine.int4_activations,
        "prompt_lookup_max": engine.prompt_lookup_max,
    }
    identical, real = True, 0
    for bs in p.batch_sizes:
        m = measure_batch(ctx, p, prompts, bs)
        metrics[f"batch{bs}"] = m
        for r in (m, m.get("draft_alone"), m.get("lookup_alone")):
            if r:
                identical &= not r["mismatched_requests"]
                real += r["mismatched_requests"] - r["near_tie_flips"]
        alone = "".join(
            f" ({name} alone {m[f'{name}_alone']['speedup']:.2f}x)" for name in ALONE if f"{name}_alone" in m
        )
        ctx.log.info(
            "serve.validate batch %d: acceptance %.3f, speedup %.2fx%s, %d diverged (%d at near-ties)",
            bs,
            m["speculative"]["acceptance_rate"] or 0.0,
            m["speedup"],
            alone,
            m["mismatched_requests"],
            m["near_tie_flips"],
        )
    metrics["outputs_identical"] = identical
    metrics["outputs_match"] = real == 0
    if (chat := chat_check(ctx, p)) is not None:
        metrics["chat"] = chat
    if ctx.is_main:
        _write_summary(ctx, metrics)
    return metrics


def chat_check(ctx: StageContext, p: ValidateParams) -> dict[str, Any] | None:
    """What ``/v1/chat/completions`` does with this target: the prompt its chat template builds
    for one held-out question, and the greedy answer up to ``max_tokens`` (stopping where the
    model's stop ids say). None for a model without a template (the server refuses chat there)."""
    from serve.api.chat_template import ChatTemplate
    from serve.engine import LLM
    from serve.sampler import SamplingParams

    template = ChatTemplate(ctx.model_dir)
    if not template.available:
        return None
    corpus = ctx.corpus()
    question = " ".join(corpus.texts(corpus.config.target_lang, "validation")[0].split()[:12])
    prompt = template.encode([{"role": "user", "content": question}])
    llm = LLM(ctx.model_dir, None, p.engine_args(1, prompt_lookup_max=0))  # the target alone, the stage's engine
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=p.max_tokens))[0]
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "turn_ended": out.finish_reason == "stop",
        "answer": out.text,
    }


def measure_batch(ctx: StageContext, p: ValidateParams, prompts: list[list[int]], bs: int) -> dict[str, Any]:
    """Plain and speculative engines (and each proposer alone, when prompt lookup is on) taking
    turns over the workload at batch size ``bs``: statistics, speedups, output comparison."""
    from serve.engine import LLM

    draft, lookup = ctx.inputs["draft"], p.engine_args(bs).prompt_lookup_max
    engines = [
        LLM(ctx.model_dir, None, p.engine_args(bs, prompt_lookup_max=0)),
        LLM(ctx.model_dir, draft, p.engine_args(bs)),
    ]
    if lookup:
        engines.append(LLM(ctx.model_dir, draft, p.engine_args(bs, prompt_lookup_max=0)))
        engines.append(LLM(ctx.model_dir, None, p.engine_args(bs)))
    outs, stats = run_interleaved(engines, prompts, bs, p.max_tokens)
    rate = stats[0]["output_tokens_per_s"]
    out: dict[str, Any] = {
        "plain": stats[0],
        "speculative": stats[1],
        "speedup": stats[1]["output_tokens_per_s"] / rate,
        **compare_outputs(engines[0], prompts, outs[0], outs[1], p.tie_tolerance),
    }
    for i, name in enumerate(ALONE if lookup else (), start=2):
        out[f"{name}_alone"] = {
            **stats[i],
            "speedup": stats[i]["output_tokens_per_s"] / rate,
            **compare_outputs(engines[0], prompts, outs[0], outs[i], p.tie_tolerance),
        }
    return out


def compare_outputs(
    engine: Any, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]], tolerance: float
) -> dict[str, Any]:
    """Diverged requests, how many of them are near-tie flips, and where each diverged."""
    found = [(i, j) for i, (a, b) in enumerate(zip(plain, spec)) if (j := first_difference(a, b)) is not None]
    gaps = [
        top2_gap(engine, prompts[i] + plain[i][:j], set(plain[i][j : j + 1] + spec[i][j : j + 1])) for i, j in found
    ]
    return {
        "mismatched_requests": len(found),
        "near_tie_flips": sum(g <= tolerance for g in gaps),
        "divergences": [
            {"request": i, "token": j, "top2_gap": g if g != float("inf") else None} for (i, j), g in zip(found, gaps)
        ],
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), or None."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(engine: Any, prefix: list[int], chosen: set[int]) -> float:
    """The target's log-probability gap between its two best next tokens after ``prefix``.

    Infinite unless the two runs' tokens are exactly those two (a divergence to any other token,
    or one run ending early, is never a near-tie).
    """
    from serve.sampler import SamplingParams

    out = engine.generate([prefix], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))[0]
    top = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1])[:2]
    if len(chosen) != 2 or {t for t, _ in top} != chosen:
        return float("inf")
    return top[0][1] - top[1][1]


def _write_summary(ctx: StageContext, metrics: dict[str, Any]) -> None:
    """A small readable record in the artifact (the manifest holds the full numbers)."""
    lines = [
        "| batch | acceptance | mean accepted length | TTFT p50 (s) | TPOT p50 (s) | tok/s plain | tok/s spec "
        "| speedup | match |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, m in metrics.items():
        if key.startswith("batch") and isinstance(m, dict):
            lines.append(_summary_row(key[5:], m["speculative"], m["plain"], m))
            for name in ALONE:
                if f"{name}_alone" in m:
                    alone = m[f"{name}_alone"]
                    lines.append(_summary_row(f"{key[5:]}, {name} alone", alone, m["plain"], alone))
    if chat := metrics.get("chat"):
        lines += ["", f"Chat: a {chat['prompt_tokens']}-token templated prompt answered in {chat['completion_tokens']}"]
        lines[-1] += f" tokens, finish reason {chat['finish_reason']}."
    (ctx.out_dir / "serve_validate.md").write_text("\n".join(lines) + "\n")


def _summary_row(label: str, s: dict[str, Any], q: dict[str, Any], m: dict[str, Any]) -> str:
    """One engine's row against the plain engine ``q``."""
    return (
        f"| {label} | {s['acceptance_rate'] or 0:.3f} | {s['mean_accepted_length'] or 0:.2f} | "
        f"{s['ttft_p50'] or 0:.4f} | {s['tpot_p50'] or 0:.4f} | {q['output_tokens_per_s']:.1f} | "
        f"{s['output_tokens_per_s']:.1f} | {m['speedup']:.2f} | {_match_cell(m)} |"
    )


def _match_cell(m: dict[str, Any]) -> str:
    """``identical``, ``N near-tie flips``, or the count of real mismatches."""
    if not m["mismatched_requests"]:
        return "identical"
    real = m["mismatched_requests"] - m["near_tie_flips"]
    return f"{m['near_tie_flips']} near-tie flips" + (f", **{real} mismatched**" if real else "")


STAGE = StageDef(
    name="serve.validate",
    params=ValidateParams,
    entry="warsha.serve_validate:run",
    description="serve target and draft with the bundled engine: acceptance, TTFT, TPOT, output equality",
    inputs=("model", "draft"),
)
