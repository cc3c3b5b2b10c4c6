"""Serving benchmark: Warsha's engine vs HF `generate` vs transformers' continuous batching.

Everything runs side by side in one process on the same checkpoint. With no model given, random
Llama-architecture models are built in-process (nothing is downloaded):

    # all scenarios on CPU with the default presets (takes several minutes on 2 cores)
    .venv/bin/python -m benchmarks.serve_bench
    # a quicker pass: fewer requests, shorter outputs
    .venv/bin/python -m benchmarks.serve_bench --quick
    # real artifacts from the pipeline
    .venv/bin/python -m benchmarks.serve_bench --model-dir runs/t/quantize --draft-dir runs/t/distill --scenarios a,b,c

Scenarios:
  a) 64 requests, prompt lengths 16-512, output lengths 16-256, greedy: Warsha vs HF `generate`
     (static padded batches of 16 in arrival order, bf16, sdpa) vs transformers' `generate_batch`
     machinery (ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512, page_size=64)).
     Tokens/s, TTFT and TPOT p50/p99, KV waste (paged vs contiguous reservations) and whether
     greedy outputs are token-identical to HF's (bf16 on the workload, fp32 on a subset).
  b) batch-1 decode: Warsha bf16 vs HF generate bf16; Warsha int4 (GPTQ format, built here by
     round-to-nearest; int8 and float32 activations) vs Warsha bf16 on the hidden-1024 preset
     and on TinyLlama-1.1B's shape (hidden 2048, 22 layers), with each int4 path's decode-logit
     error against the dequantized float32 model.
  g) the real Gemma 3 270M (the `real` extra; skipped with a message without it): batch-1 decode
     and the mixed workload (16 requests with --quick), Warsha vs HF generate, float32 and bf16
     (`benchmarks/real_gemma_bench.py`).
  c) speculative decoding at batch 1, 4, 16: the same engine with and without the draft, with the
     measured cost ratio c of a draft forward to a target forward and the predicted speedup
     (1 - a^(k+1)) / ((1 - a)(1 + k c)).
     The default draft is the first layer (a layer-skip draft) of a 16-layer target whose later
     layers are damped: a synthetic stand-in for a distilled draft that agrees with its target,
     at c ~ 0.1. Speedup is tokens/s including prefill; `decode` the TPOT ratio.
     With --draft-dir, a draft_vocab.json beside the draft (distill's draft_vocab_size) restricts
     its head as the engine does, and c is timed that way.

On a CPU without native bf16 (AVX2 only; `serve.cpu`), Warsha's bf16 model keeps bf16 weights,
activations and KV cache but runs its matmuls in float32 (rounded to bf16 once), while HF runs
torch's emulated bf16 kernels: the results record `cpu_native_bf16` so that ratios from the two
kinds of machine are not mixed up.

Targets the team aims for are printed as ratios and never asserted. `--threads` defaults to 1
(on a shared machine extra OpenMP threads mostly wait on each other); the README's figures use
`--threads 2`, the idle 2-core host's cores, with one-thread figures beside them. Every engine
runs with the same setting. The predicted speedup in (c) assumes independent acceptance; drafts
fail in runs, so the measured `len` (tokens per verification) is usually higher than it implies.
Results go to benchmarks/results/serve_bench-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from warsha.cli import quiet_environment  # noqa: E402

quiet_environment()  # offline, and none of the libraries' every-run warnings (as the `warsha` CLI)

import torch  # noqa: E402

from serve import LLM, SamplingParams, cpu_kernels  # noqa: E402
from serve.attention import SeqChunk  # noqa: E402
from serve.cpu import bf16_matmul_is_fast  # noqa: E402
from serve.model import DecoderModel, ForwardBatch  # noqa: E402
from serve.stats import percentile  # noqa: E402
from serve.weights import DRAFT_VOCAB_FILE, read_draft_vocab  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    ),
    "medium": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8
    ),
    "spec": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8
    ),
    # TinyLlama-1.1B's shape (22 layers): a real small model, where the bf16 head is 6% of the weights
    "large": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    ),
}
RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, results: dict[str, Any]) -> Path:
    """`results` as benchmarks/results/<name>-<time>.json; prints and returns the path."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    return out


# --------------------------------------------------------------------------- models
def build_random_model(
    path: Path, preset: str, seed: int = 0, damp_from: int | None = None, vocab: int = 32000, damp: float = 0.006
) -> Path:
    """A random bf16 Llama checkpoint; layers from `damp_from` on optionally scaled down by `damp`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        **PRESETS[preset],
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if damp_from is not None:
        with torch.no_grad():
            for layer in model.model.layers[damp_from:]:
                layer.self_attn.o_proj.weight.mul_(damp)
                layer.mlp.down_proj.weight.mul_(damp)
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(path))
    return path


def build_layer_skip_draft(target: Path, path: Path, num_layers: int = 1) -> Path:
    """The target's first `num_layers` layers with its embeddings and head."""
    from safetensors.torch import load_file, save_file

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(target / "model.safetensors"))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int64 [R*8, C] of 0..15 -> int32 [R, C], eight nibbles per word along dim 0, lowest first."""
    v = values.reshape(-1, 8, values.shape[1])
    word = sum(v[:, j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def quantize_rtn_gptq(src: Path, dst: Path, group_size: int = 128) -> Path:
    """Round-to-nearest 4-bit in the GPTQ v1 checkpoint format (a stand-in for a GPTQ run)."""
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name[: -len(".weight")]
        if not (name.endswith("_proj.weight") and ".layers." in name):
            out[name] = w.half()
            continue
        wt = w.float().T  # [K, N]
        k_in, n_out = wt.shape
        groups = wt.reshape(k_in // group_size, group_size, n_out)
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = torch.round(-lo / scale).clamp(1, 15)
        q = torch.clamp(torch.round(groups / scale[:, None]) + zero[:, None], 0, 15).reshape(k_in, n_out).long()
        out[f"{module}.qweight"] = _pack_rows(q)
        out[f"{module}.qzeros"] = _pack_rows((zero.long() - 1).T.contiguous()).T.contiguous()
        out[f"{module}.scales"] = scale.half()
        out[f"{module}.g_idx"] = (torch.arange(k_in) // group_size).to(torch.int32)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": False,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def dequantized_reference(int4_dir: Path) -> DecoderModel:
    """float32 model holding exactly the GPTQ checkpoint's dequantized weights (isolates the kernel)."""
    import dataclasses

    from serve.config import ModelConfig
    from serve.quant import gptq_dequantize
    from serve.weights import load_state_dict

    cfg = ModelConfig.from_dir(int4_dir)
    state = load_state_dict(int4_dir)
    for name in [n for n in state if n.endswith(".qweight")]:
        m = name[: -len(".qweight")]
        state[f"{m}.weight"] = gptq_dequantize(
            state.pop(name), state.pop(f"{m}.qzeros"), state.pop(f"{m}.scales"), state.pop(f"{m}.g_idx")
        )
    return DecoderModel(dataclasses.replace(cfg, quant=None), state, torch.float32)


def hf_load(path: Path, dtype: torch.dtype = torch.bfloat16):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()


# --------------------------------------------------------------------------- workloads
def workload(
    n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


def latency_summary(ttft: list[float], tpot: list[float]) -> dict[str, float | None]:
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
    }


REPEATS = 1


def run_warsha(
    model_dir: Path, reqs: list[tuple[list[int], int]], draft_dir: Path | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Best (highest tok/s) of REPEATS runs with a fresh engine each; the machine is shared and noisy."""
    runs = [run_warsha_once(model_dir, reqs, draft_dir, **kwargs) for _ in range(REPEATS)]
    return max(runs, key=lambda r: r["tok_per_s"])


def run_warsha_once(
    model_dir: Path, reqs: list[tuple[list[int], int]], draft_dir: Path | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Offline run of all requests at once; metrics from the engine's own statistics."""
    llm = LLM(model_dir, draft_dir, **kwargs)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    from serve.stats import EngineStats

    llm.stats = EngineStats()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    wall = time.perf_counter() - start
    s = llm.stats.summary()
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tok_per_s": tokens / wall,
        "outputs": [o.token_ids for o in outs],
        **{
            k: s[k]
            for k in (
                "ttft_p50",
                "ttft_p99",
                "tpot_p50",
                "tpot_p99",
                "kv_waste",
                "kv_waste_contiguous",
                "kv_waste_max_len",
                "preemptions",
                "acceptance_rate",
                "mean_accepted_length",
                "spec_steps",
                "plain_decode_steps",
            )
        },
    }


class _Clock:
    """A logits processor that only records when each generation step happened."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model, reqs: list[tuple[list[int], int]], batch_size: int = 16) -> dict[str, Any]:  # noqa: ANN001
    """Best of REPEATS runs of `_run_hf_static_once`."""
    return max((_run_hf_static_once(model, reqs, batch_size) for _ in range(REPEATS)), key=lambda r: r["tok_per_s"])


def _run_hf_static_once(model, reqs: list[tuple[list[int], int]], batch_size: int = 16) -> dict[str, Any]:  # noqa: ANN001
    """HF generate on static left-padded batches in arrival order; each batch runs to its longest output."""
    from transformers import GenerationConfig, LogitsProcessorList

    outputs, ttft, tpot, waste_alloc, waste_used = [], [], [], 0, 0
    start = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        chunk = reqs[b : b + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        max_new = max(n for _, n in chunk)
        clock = _Clock()
        cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=cfg, logits_processor=LogitsProcessorList([clock])
            )
        for row, (p, n) in enumerate(chunk):
            outputs.append(out[row, width : width + n].tolist())
            ttft.append(clock.times[0] - start)
            if n > 1:
                tpot.append((clock.times[n - 1] - clock.times[0]) / (n - 1))
            waste_used += len(p) + n
        waste_alloc += len(chunk) * (width + max_new)
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in reqs)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tok_per_s": tokens / wall,
        "outputs": outputs,
        "kv_waste_static_batch": 1 - waste_used / waste_alloc,
        **latency_summary(ttft, tpot),
    }


def run_hf_cb(model, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:  # noqa: ANN001
    """Best of REPEATS runs of `_run_hf_cb_once`."""
    return max((_run_hf_cb_once(model, reqs) for _ in range(REPEATS)), key=lambda r: r["tok_per_s"])


def _run_hf_cb_once(model, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:  # noqa: ANN001
    """transformers' continuous batching manager (what `generate_batch` drives), per-request lengths."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512, page_size=64)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in reqs))
    results: dict[str, Any] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
            for i, (p, n) in enumerate(reqs)
        ]
        while len(results) < len(reqs):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped early")
    wall = time.perf_counter() - start
    outputs, ttft, tpot = [], [], []
    for rid in ids:
        r = results[rid]
        outputs.append(list(r.generated_tokens))
        stamps = r.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tok_per_s": tokens / wall,
        "outputs": outputs,
        **latency_summary(ttft, tpot),
    }


def identical(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose outputs are token-identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each output that matches before the first differing token."""
    total = 0.0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        same = next((i for i in range(n) if x[i] != y[i]), n)
        total += same / max(n, 1)
    return total / len(a)


# --------------------------------------------------------------------------- scenarios
def scenario_a(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    n, out_hi = (16, 64) if args.quick else (64, 256)
    reqs = workload(n, (16, 512), (16, out_hi), 32000, seed=0)
    res: dict[str, Any] = {"requests": n}
    res["warsha"] = run_warsha(model_dir, reqs)
    hf = hf_load(model_dir)
    res["hf_generate"] = run_hf_static(hf, reqs)
    if not args.skip_cb:
        try:
            res["hf_continuous_batching"] = run_hf_cb(hf, reqs)
        except Exception as exc:  # a peer failing must not hide our numbers; record why
            res["hf_continuous_batching"] = {"error": repr(exc)}
    res["identical_to_hf_bf16"] = identical(res["warsha"]["outputs"], res["hf_generate"]["outputs"])
    # bf16 noise floor: HF's own batch-16 outputs against HF at batch 1 on a few requests
    few = [(p, min(n, 48)) for p, n in reqs[:4]]
    b1 = [
        hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p, m in few
    ]
    res["bf16_prefix_agreement_vs_hf_batch1"] = {
        "warsha": prefix_agreement([o[:m] for o, (_, m) in zip(res["warsha"]["outputs"], few)], b1),
        "hf_generate_batch16": prefix_agreement([o[:m] for o, (_, m) in zip(res["hf_generate"]["outputs"], few)], b1),
    }
    small = workload(8, (8, 64), (24, 24), 32000, seed=1)
    hf32 = hf_load(model_dir, torch.float32)
    ref = [
        hf32.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p, m in small
    ]
    res["identical_to_hf_fp32_subset"] = identical(run_warsha(model_dir, small, dtype="float32")["outputs"], ref)
    return res


def decode_rate(model_dir: Path, prompt: list[int], n: int, **kwargs: Any) -> float:
    """Batch-1 decode tokens/s (1 / TPOT), best of REPEATS."""
    return max(1 / run_warsha_once(model_dir, [(prompt, n)], **kwargs)["tpot_p50"] for _ in range(REPEATS))


def hf_decode_rate(model, prompt: list[int], n: int) -> float:  # noqa: ANN001
    """Batch-1 decode tokens/s of HF generate, best of REPEATS."""
    return max(hf_decode_rate_once(model, prompt, n) for _ in range(REPEATS))


def hf_decode_rate_once(model, prompt: list[int], n: int) -> float:  # noqa: ANN001
    from transformers import GenerationConfig, LogitsProcessorList

    clock = _Clock()
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), generation_config=cfg, logits_processor=LogitsProcessorList([clock]))
    return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def scenario_b(small_dir: Path, int4_dirs: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    n = 32 if args.quick else 128
    prompt = workload(1, (128, 128), (1, 1), 32000, seed=2)[0][0]
    res: dict[str, Any] = {"new_tokens": n}
    hf = hf_load(small_dir)
    hf_decode_rate(hf, prompt[:8], 4)
    res["small_hf_bf16_tok_s"] = hf_decode_rate(hf, prompt, n)
    res["small_warsha_bf16_tok_s"] = decode_rate(small_dir, prompt, n)
    for preset, bf16_dir in int4_dirs.items():
        int4_dir = quantize_rtn_gptq(bf16_dir, bf16_dir.parent / (bf16_dir.name + "-gptq"))
        ref = dequantized_reference(int4_dir).prefill_logits(prompt[:16])
        for act in ("int8", "float"):  # decode rows: activations quantized per 32 features, or float32
            model = DecoderModel.load(int4_dir, int4_activations=act)
            got = torch.stack([decode_logits(model, prompt[: 8 + i]) for i in range(8)])
            res[f"{preset}_int4_{act}_decode_logits_rel_error_vs_dequantized_fp32"] = float(
                (got - ref[7:15]).norm() / ref[7:15].norm()
            )
            res[f"{preset}_warsha_int4_{act}_tok_s"] = decode_rate(int4_dir, prompt, n, int4_activations=act)
        res[f"{preset}_warsha_bf16_tok_s"] = decode_rate(bf16_dir, prompt, n)
        res[f"{preset}_hf_bf16_tok_s"] = hf_decode_rate(hf_load(bf16_dir), prompt, n)
    return res


def decode_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Logits of the last of `ids` computed as a one-row decode step (the path batch-1 decode runs)."""
    bs = 16
    blocks = -(-len(ids) // bs)
    kv = model.new_kv_cache(blocks, bs)
    table = list(range(blocks))
    head = len(ids) - 1
    model.forward(
        ForwardBatch(
            torch.tensor(ids[:head]), torch.arange(head), [SeqChunk(0, head, head, table)], torch.tensor([head - 1])
        ),
        kv,
    )
    step = ForwardBatch(
        torch.tensor(ids[head:]), torch.tensor([head]), [SeqChunk(0, 1, len(ids), table)], torch.tensor([0])
    )
    return model.forward(step, kv)[0]


def forward_seconds(model: DecoderModel, batch: int, context: int, repeats: int = 5) -> float:
    """Time of one decode forward of `batch` sequences at `context` tokens (scratch cache)."""
    bs = 16
    blocks = -(-context // bs)
    kv = model.new_kv_cache(batch * blocks, bs)
    chunks = [SeqChunk(i, 1, context, list(range(i * blocks, (i + 1) * blocks))) for i in range(batch)]
    fb = ForwardBatch(torch.full((batch,), 5), torch.full((batch,), context - 1), chunks, torch.arange(batch))
    model.forward(fb, kv)
    start = time.perf_counter()
    for _ in range(repeats):
        model.forward(fb, kv)
    return (time.perf_counter() - start) / repeats


def scenario_c(target_dir: Path, draft_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = 32 if args.quick else 96
    k = args.num_spec_tokens
    target, draft = DecoderModel.load(target_dir), DecoderModel.load(draft_dir)
    if (draft_dir / DRAFT_VOCAB_FILE).is_file():  # time the draft as the engine runs it
        draft.restrict_head(read_draft_vocab(draft_dir / DRAFT_VOCAB_FILE))
    res: dict[str, Any] = {"k": k, "new_tokens": n, "batches": {}, "draft_head_rows": int(draft.lm_head.shape[0])}
    vocab = target.config.vocab_size
    for batch in (1, 4, 16):
        reqs = workload(batch, (32, 96), (n, n), vocab, seed=3 + batch)
        plain = run_warsha(target_dir, reqs)
        spec = run_warsha(target_dir, reqs, draft_dir, num_speculative_tokens=k)
        forced = run_warsha(target_dir, reqs, draft_dir, num_speculative_tokens=k, adaptive_speculation=False)
        c = forward_seconds(draft, batch, 96) / forward_seconds(target, batch, 96)
        alpha = spec["acceptance_rate"] or 0.0
        predicted = ((1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1) / (1 + k * c)
        res["batches"][batch] = {
            "plain_tok_s": plain["tok_per_s"],
            "spec_tok_s": spec["tok_per_s"],
            "speedup": spec["tok_per_s"] / plain["tok_per_s"],
            # decode phase alone (TPOT, after the first token): what speculation changes; tok/s above includes prefill
            "decode_speedup": plain["tpot_p50"] / spec["tpot_p50"],
            "always_spec_tok_s": forced["tok_per_s"],
            "always_spec_speedup": forced["tok_per_s"] / plain["tok_per_s"],
            "acceptance_rate": spec["acceptance_rate"],
            "mean_accepted_length": spec["mean_accepted_length"],
            "cost_ratio_c": c,
            "predicted_speedup": predicted,
            "spec_steps": spec["spec_steps"],
            "plain_steps": spec["plain_decode_steps"],
            "identical_to_plain": identical(plain["outputs"], spec["outputs"]),
        }
    return res


# --------------------------------------------------------------------------- report
def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def print_report(results: dict[str, Any]) -> None:
    a = results.get("a")
    if a:
        print("\n(a) mixed workload:", a["requests"], "requests")
        print(f"{'engine':26} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
        for name in ("warsha", "hf_generate", "hf_continuous_batching"):
            r = a.get(name) or {}
            if "tok_per_s" in r:
                print(
                    f"{name:26} {r['tok_per_s']:8.1f} {_fmt(r['ttft_p50']):>9} {_fmt(r['ttft_p99']):>9} "
                    f"{_fmt(r['tpot_p50']):>9} {_fmt(r['tpot_p99']):>9}"
                )
            elif r:
                print(f"{name:26} failed: {r.get('error')}")
        w = a["warsha"]
        print(
            f"KV waste: paged {_fmt(w['kv_waste'])}, contiguous prompt+max_tokens {_fmt(w['kv_waste_contiguous'])}, "
            f"contiguous max_model_len {_fmt(w['kv_waste_max_len'])}, HF static batch "
            f"{_fmt(a['hf_generate']['kv_waste_static_batch'])}"
        )
        print(
            f"greedy identical to HF: bf16 workload {_fmt(a['identical_to_hf_bf16'])}, fp32 subset "
            f"{_fmt(a['identical_to_hf_fp32_subset'])}"
        )
        agree = a["bf16_prefix_agreement_vs_hf_batch1"]
        print(
            f"bf16 prefix agreement with HF batch-1: warsha {_fmt(agree['warsha'])}, HF's own batch-16 "
            f"{_fmt(agree['hf_generate_batch16'])}"
        )
        for name, target in (("hf_generate", 2.0), ("hf_continuous_batching", 3.0)):
            if "tok_per_s" in (a.get(name) or {}):
                print(f"ratio vs {name}: {w['tok_per_s'] / a[name]['tok_per_s']:.2f}x (team target >= {target}x)")
    b = results.get("b")
    if b:
        print("\n(b) batch-1 decode tok/s:", {k: _fmt(v) for k, v in b.items()})
        print(
            f"ratio Warsha/HF bf16 (small): {b['small_warsha_bf16_tok_s'] / b['small_hf_bf16_tok_s']:.2f}x "
            "(target >= 1.2x)"
        )
        for preset in PRESETS:
            for act in ("int8", "float"):
                if f"{preset}_warsha_int4_{act}_tok_s" in b:
                    ratio = b[f"{preset}_warsha_int4_{act}_tok_s"] / b[f"{preset}_warsha_bf16_tok_s"]
                    print(f"ratio int4 ({act} activations) / bf16, {preset}: {ratio:.2f}x (target >= 2x)")
    c = results.get("c")
    if c:
        print(f"\n(c) speculative decoding, k={c['k']}")
        print(
            f"{'batch':>5} {'plain':>8} {'adaptive':>8} {'speedup':>8} {'decode':>7} {'always':>8} "
            f"{'accept':>7} {'len':>5} {'c':>6} {'pred':>6} {'same':>5}"
        )
        for bsz, r in c["batches"].items():
            print(
                f"{bsz:>5} {r['plain_tok_s']:8.1f} {r['spec_tok_s']:8.1f} {r['speedup']:8.2f} "
                f"{r['decode_speedup']:7.2f} {r['always_spec_speedup']:8.2f} {_fmt(r['acceptance_rate']):>7} "
                f"{_fmt(r['mean_accepted_length']):>5} {r['cost_ratio_c']:6.2f} {r['predicted_speedup']:6.2f} "
                f"{_fmt(r['identical_to_plain']):>5}"
            )
        print(
            "team target: batch 1 speedup >= 1.8x. speedup = tok/s with prefill; decode = TPOT ratio. 'same' = "
            "greedy outputs identical with and without the draft;"
            " in bf16 the verify forward (k+1 queries) rounds differently from 1-query decode, so near-ties can flip"
            " (the fp32 tests prove exactness)"
        )


def main(argv: list[str] | None = None) -> int:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, help="HF model dir (default: random 'small' preset)")
    p.add_argument("--draft-dir", type=Path, help="draft for scenario c (needs --model-dir)")
    p.add_argument("--scenarios", default="a,b,c,g")
    p.add_argument("--quick", action="store_true", help="fewer requests and shorter outputs")
    p.add_argument("--skip-cb", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--no-medium", action="store_true", help="skip the hidden-1024 and -2048 presets (int4 and spec)")
    p.add_argument(
        "--int4-presets", default="medium,large", help="presets for the int4-vs-bf16 decode comparison of (b)"
    )
    p.add_argument(
        "--real-requests", type=int, default=None, help="requests of (g)'s mixed workload (default 64, 16 with --quick)"
    )
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best is reported")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "warsha-serve-bench")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    global REPEATS
    REPEATS = max(1, args.repeats)
    scenarios = set(args.scenarios.split(","))
    needs_small = bool(scenarios & {"a", "b"})
    small = args.model_dir or (build_random_model(args.workdir / "small", "small") if needs_small else None)
    presets = [] if args.no_medium or args.model_dir or "b" not in scenarios else args.int4_presets.split(",")
    presets = [p for p in presets if p]
    int4_dirs = {p: build_random_model(args.workdir / p, p) for p in presets}
    results: dict[str, Any] = {
        "threads": args.threads,
        "repeats": REPEATS,
        "quick": args.quick,
        "model_dir": str(small),
        "torch": torch.__version__,
        "cpu_native_bf16": bf16_matmul_is_fast(),
        "serve_cpu_kernels": cpu_kernels.available(),
    }
    if "a" in scenarios:
        results["a"] = scenario_a(small, args)
    if "b" in scenarios:
        results["b"] = scenario_b(small, int4_dirs, args)
    if "c" in scenarios:
        if args.model_dir and args.draft_dir:
            target, draft = args.model_dir, args.draft_dir
        elif not args.no_medium:
            # a 1-layer draft of a 16-layer target with vocab 8192 costs c ~ 0.1 of it, the ratio of
            # real pairs (70B/7B); vocab 8192 keeps the shared head from dominating
            target = build_random_model(args.workdir / "spec-target-v8k-16l", "spec", seed=7, damp_from=1, vocab=8192)
            draft = build_layer_skip_draft(target, args.workdir / "spec-draft-v8k-16l")
        else:
            target = None
        if target is not None:
            results["c"] = scenario_c(target, draft, args)
    if "g" in scenarios:
        from benchmarks.real_gemma_bench import scenario_g

        helpers = dict(
            workload=workload,
            run_warsha=run_warsha,
            run_hf_static=run_hf_static,
            decode_rate=decode_rate,
            hf_decode_rate=hf_decode_rate,
            hf_load=hf_load,
            identical=identical,
        )
        results["g"] = scenario_g(args, helpers)
    print_report(results)
    if "g" in results:
        from benchmarks.real_gemma_bench import print_g

        print_g(results["g"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"serve_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for part in results.values():
        if isinstance(part, dict):
            for r in part.values():
                if isinstance(r, dict):
                    r.pop("outputs", None)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
