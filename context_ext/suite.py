"""The long/short-context evaluation every method gets, shared by the stage and the benchmark.

One model is scored on: passkey retrieval and sliding-window perplexity at each length
(1x..8x the original context), and perplexity at or below the original length, which the
report divides by the unscaled model's (the short-context regression that static scaling
tends to cause silently).
"""

from __future__ import annotations

import ctypes
import gc
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from context_ext import passkey, scaling

# Report labels: the method and whether it was fine-tuned.
LABELS = {"none": "none", "linear": "PI", "ntk": "NTK", "yarn": "YaRN"}


def label(method: str, finetuned: bool) -> str:
    """``YaRN+ft``-style label used in tables, plots and metric keys."""
    return LABELS[method] + ("+ft" if finetuned else "")


@dataclass
class EvalSettings:
    """What is measured and how precisely (the stage's eval params map onto this)."""

    lengths: list[int]
    short_lengths: list[int]
    depths: list[float] = field(default_factory=lambda: list(passkey.EVAL_DEPTHS))
    min_trials: int = 40
    max_trials: int = 400
    half_width: float = 0.05
    batch_tokens: int = 4096
    seed: int = 0

    def batch_for(self, length: int) -> int:
        """Sequences per forward pass at ``length`` (bounds activation memory at 8x)."""
        return max(1, self.batch_tokens // length)


@dataclass
class EvalData:
    """Held-out material: passkey filler tokens and long perplexity documents."""

    fmt: passkey.PasskeyFormat
    filler: list[int]
    ppl_texts: list[str]
    source_texts: list[str] = field(default_factory=list)  # the other language, scored at short lengths


def variant_config(
    base_cfg: dict[str, Any],
    method: str,
    factor: float,
    original: int | None,
    compose: bool = False,
    ntk_dynamic: bool = False,
    yarn_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config dict a method writes (``none`` leaves the base config as it is)."""
    if method == "none":
        return dict(base_cfg)
    return scaling.scaled_config(base_cfg, method, factor, original, compose, ntk_dynamic, yarn_options)  # type: ignore[arg-type]


def load_variant(model_dir: Path, cfg: dict[str, Any], dtype: str = "bfloat16") -> Any:
    """Load the weights of ``model_dir`` under config ``cfg`` (RoPE is built from the config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    body = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **body)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=getattr(torch, dtype))
    return model.eval()


def peak_rss_gb() -> float:
    """Peak resident memory of this process since start or the last ``reset_peak_rss`` (GB).

    Reads ``VmHWM`` from ``/proc/self/status``, which ``reset_peak_rss`` can lower; elsewhere
    ``ru_maxrss`` (never reset; Linux reports kilobytes).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def release_freed_memory() -> bool:
    """Collect garbage and hand the allocator's free pages back to the kernel.

    Why: glibc and tcmalloc both keep freed pages mapped for reuse, so after a long-row
    fine-tune the process stays at the fine-tune's peak with nothing live; an evaluation
    measured from there reports the fine-tune's memory, not its own. Calls tcmalloc's
    ``MallocExtension_ReleaseFreeMemory`` where tcmalloc is loaded and glibc's ``malloc_trim``
    (which also covers anything glibc itself still holds). False where neither exists.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    released = False
    for name, args in (("MallocExtension_ReleaseFreeMemory", []), ("malloc_trim", [ctypes.c_size_t])):
        fn = getattr(libc, name, None)
        if fn is None:
            continue
        fn.argtypes, fn.restype = args, None
        fn(*([0] * len(args)))  # malloc_trim's result says whether anything was freed; either way it ran
        released = True
    return released


def reset_peak_rss() -> bool:
    """Restart the peak-memory count at the current resident size (Linux ``clear_refs`` 5).

    Why: a process that fine-tuned before evaluating would otherwise report the fine-tune's
    peak as the evaluation's, about twice what the evaluation itself needs.
    False where the kernel does not allow it; the peak then covers the whole process.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def evaluate(model: Any, tokenizer: Any, data: EvalData, s: EvalSettings, desc: str = "") -> dict[str, Any]:
    """Passkey cells and perplexities for one model: the per-method block of the metrics."""
    from warsha.evaluate import likelihood

    out: dict[str, Any] = {"passkey": {}, "perplexity": {}}
    release_freed_memory()  # so the evaluation's own peak is what is measured
    out["peak_rss_scope"] = "evaluation" if reset_peak_rss() else "process"
    for length in s.lengths:
        cell = passkey.evaluate_length(
            model,
            data.fmt,
            data.filler,
            length,
            s.depths,
            s.min_trials,
            s.max_trials,
            s.half_width,
            s.batch_for(length),
            s.seed,
        )
        out["passkey"][str(length)] = cell.as_dict()
    for length in sorted(set(s.lengths) | set(s.short_lengths)):
        lk = likelihood(
            model, tokenizer, data.ppl_texts, length, batch_size=s.batch_for(length), desc=f"{desc} ppl@{length}"
        )
        out["perplexity"][str(length)] = lk.perplexity
    if data.source_texts:
        out["perplexity_source"] = {}
        for length in s.short_lengths:
            lk = likelihood(
                model,
                tokenizer,
                data.source_texts,
                length,
                batch_size=s.batch_for(length),
                desc=f"{desc} source ppl@{length}",
            )
            out["perplexity_source"][str(length)] = lk.perplexity
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def short_context_ratios(
    results: dict[str, dict[str, Any]], short_lengths: Sequence[int], key: str = "perplexity"
) -> dict[str, dict[str, float]]:
    """Each method's perplexity at short lengths divided by the unscaled model's (1.03 = +3%).

    ``key="perplexity_source"``: the same for the corpus's other language (empty when absent).
    """
    if key not in results["none"]:
        return {}
    ref = results["none"][key]
    return {
        name: {str(n): r[key][str(n)] / ref[str(n)] for n in short_lengths} for name, r in results.items() if key in r
    }
