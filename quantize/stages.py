"""Stages ``quantize.awq``, ``quantize.gptq``, ``quantize.rtn`` and ``quantize.gguf``.

Imports nothing heavy: the runner imports this module to validate recipes in well under a
second; torch and transformers are imported inside ``quantize.run`` when a stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from warsha.schema import check, ge, gt, le
from warsha.stage import StageDef

if TYPE_CHECKING:
    from warsha.widths import Widths


def _group_size_check(value: int | str) -> str | None:
    """``auto``, or a multiple of 8 of at least 8."""
    if value == "auto" or (isinstance(value, int) and value >= 8 and value % 8 == 0):
        return None
    return f"must be 'auto' or a multiple of 8 >= 8, got {value!r}"


@dataclass
class RTNParams:
    """Round-to-nearest: the baseline every calibrated method must beat."""

    bits: Literal[3, 4, 8] = field(default=4, metadata=check(help="bits per weight"))
    group_size: int | Literal["auto"] = field(
        default=128,
        metadata=check(
            _group_size_check, help="input columns per scale/zero; auto: the largest of 128/64/32 that fits"
        ),
    )
    sym: bool = field(default=True, metadata=check(help="symmetric grid (zero fixed at 2**(bits-1))"))
    format: Literal["gptq", "awq"] = field(
        default="gptq", metadata=check(help="checkpoint layout, see quantize/FORMAT.md")
    )
    on_bad_group: Literal["error", "fallback"] = field(
        default="error", metadata=check(help="a linear the group size does not divide: stop, or keep it unquantized")
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata=check(help="dtype of the layer-by-layer computation")
    )
    save_dtype: Literal["bfloat16", "float16", "float32", "auto"] = field(
        default="bfloat16",
        metadata=check(help="dtype of the tensors left unquantized (embedding, norms, head); auto: the input's"),
    )
    embedding_bits: Literal[8, 16] = field(
        default=16,
        metadata=check(
            help="8: the embedding (and an untied head) as int8 rows, one scale each, half the bytes;"
            " serve loads it, vLLM/transformers/GPTQModel do not. 16: in save_dtype"
        ),
    )
    eval_langs: list[str] = field(default_factory=lambda: ["ar", "en"])
    eval_documents: int = field(default=200, metadata=check(ge(1), help="validation documents per language"))
    eval_max_length: int = field(default=512, metadata=check(ge(16), help="likelihood window in tokens"))
    eval_batch_size: int = field(default=8, metadata=check(ge(1)))

    def validate(self) -> list[str]:
        """Cross-field checks."""
        problems = []
        if self.format == "awq" and self.bits != 4:
            problems.append(
                f"format: the AWQ GEMM layout holds 4-bit weights only, got bits={self.bits}; use format: gptq"
            )
        return problems


@dataclass
class CalibratedParams(RTNParams):
    """Fields shared by the calibrated methods."""

    n_samples: int = field(default=128, metadata=check(ge(1), help="calibration rows"))
    seq_len: int = field(default=512, metadata=check(ge(16), help="tokens per calibration row (documents are packed)"))
    calib_langs: list[str] = field(default_factory=lambda: ["ar", "en"])
    batch_size: int = field(default=8, metadata=check(ge(1), help="calibration rows per forward pass"))
    compare_rtn: bool = field(default=True, metadata=check(help="also measure RTN on the same model"))


@dataclass
class GPTQParams(CalibratedParams):
    """GPTQ: Hessian-aware error feedback."""

    damp: float = field(default=0.01, metadata=check(gt(0.0), le(1.0), help="fraction of mean diag(H) added"))
    desc_act: bool = field(default=False, metadata=check(help="act-order: columns by decreasing diag(H)"))
    static_groups: bool = field(default=True, metadata=check(help="with desc_act: fix group grids before reordering"))
    blocksize: int = field(default=128, metadata=check(ge(1), help="columns per lazy update block"))

    def validate(self) -> list[str]:
        """Cross-field checks."""
        problems = super().validate()
        if self.format == "awq" and self.desc_act and not self.static_groups:
            problems.append(
                "format: act-order without static groups needs g_idx, which the AWQ layout lacks; use format: gptq"
            )
        return problems


@dataclass
class AWQParams(CalibratedParams):
    """AWQ: activation-aware scales and clipping."""

    sym: bool = field(default=False, metadata=check(help="symmetric grid (AWQ's zero_point: false)"))
    format: Literal["gptq", "awq"] = field(
        default="awq", metadata=check(help="checkpoint layout, see quantize/FORMAT.md")
    )
    n_grid: int = field(default=20, metadata=check(ge(2), help="alpha values tried in [0, 1)"))
    max_shrink: float = field(default=0.5, metadata=check(gt(0.0), le(0.9), help="largest clipping shrink of the max"))
    clip: bool = field(default=True, metadata=check(help="search per-group clipping thresholds"))
    duo_scaling: bool = field(
        default=False,
        metadata=check(
            help="also divide by in-group weight salience (llm-compressor's default; off: it scored worse here)"
        ),
    )
    n_samples: int = field(default=64, metadata=check(ge(1), help="calibration rows"))
    search_bf16: bool | None = field(
        default=None,
        metadata=check(
            help="rerun the inspected blocks of the scale search under bf16 autocast; null: where the"
            " device is fast at it (warsha.precision)"
        ),
    )


@dataclass
class GGUFParams:
    """``quantize.gguf``: llama.cpp's F16 GGUF and its quantized types, an Ollama Modelfile."""

    types: list[str] = field(
        default_factory=lambda: ["Q8_0", "Q4_K_M"], metadata=check(help="llama.cpp types quantized from the F16 file")
    )
    llamacpp_venv: str = field(
        default="~/.cache/warsha-peers/llamacpp",
        metadata=check(help="venv with llama-cpp-python and its sdist (benchmarks/peers/setup_llamacpp.sh)"),
    )
    modelfile_type: str | None = field(
        default=None, metadata=check(help="the GGUF the Modelfile's FROM names (default: the last of types)")
    )
    ollama_parameters: dict[str, Any] = field(
        default_factory=dict, metadata=check(help="extra Modelfile PARAMETER lines, e.g. {temperature: 0.7}")
    )
    eval_langs: list[str] = field(default_factory=lambda: ["ar", "en"])
    eval_documents: int = field(default=16, metadata=check(ge(1), help="validation documents per language"))
    eval_max_length: int = field(default=256, metadata=check(ge(16), help="likelihood window in tokens"))
    tokenize_documents: int = field(
        default=200, metadata=check(ge(1), help="held-out texts per language whose tokenization is compared")
    )
    num_prompts: int = field(default=4, metadata=check(ge(1), help="greedy prompts, F16 GGUF vs serve float32"))
    prompt_tokens: int = field(default=32, metadata=check(ge(2)))
    max_tokens: int = field(default=24, metadata=check(ge(1), help="greedy tokens per prompt"))
    tie_tolerance: float = field(
        default=0.01,
        metadata=check(ge(0.0), help="a divergence between serve's two best tokens closer than this is a near-tie"),
    )
    speed_tokens: int = field(default=32, metadata=check(ge(1), help="decode steps timed per type"))
    threads: int = field(default=2, metadata=check(ge(1)))

    def validate(self) -> list[str]:
        """Type names llama.cpp knows, and a Modelfile target that is produced."""
        from quantize.gguf_tool import FTYPES

        problems = [
            f"types: unknown llama.cpp type {t!r} (known: {', '.join(FTYPES)})" for t in self.types if t not in FTYPES
        ]
        if self.modelfile_type is not None and self.modelfile_type not in {"F16", *self.types}:
            problems.append(f"modelfile_type: {self.modelfile_type!r} is neither F16 nor one of types {self.types}")
        return problems


def check_widths(params: RTNParams, widths: "Widths") -> list[str]:
    """Planning-time check: every quantized linear of a model with these widths fits the grid.

    One line per pattern of bad linears (they repeat in every layer), with the group sizes
    that would fit; nothing when ``on_bad_group: fallback`` keeps such linears in float.
    """
    from quantize.arch import arch_for
    from quantize.shapes import advice, fitting_group_sizes, linear_shapes, shape_problems, summarize

    try:
        arch = arch_for(widths.model_type)
    except ValueError as exc:
        return [f"group_size: cannot check the model's widths: {exc}"]
    shapes = linear_shapes(arch, widths)
    fits = fitting_group_sizes(shapes.values(), params.bits, params.format)
    where = f"(widths from {widths.source})"
    if params.group_size == "auto":
        return [] if fits else [f"group_size: auto: {advice('auto', fits)} {where}"]
    bad = shape_problems(shapes, widths.num_layers, params.bits, params.group_size, params.format)
    if not bad or params.on_bad_group == "fallback":
        return []
    tail = f"; {advice(params.group_size, fits)} {where}"
    return [f"group_size: {line}{tail}" for line in summarize(bad, widths.num_layers)]


def _stage(name: str, params: type, entry: str, description: str) -> StageDef:
    return StageDef(name, params, entry, description, check_widths="quantize.stages:check_widths")


STAGES: dict[str, StageDef] = {
    "awq": _stage(
        "quantize.awq", AWQParams, "quantize.run:run_awq", "AWQ 4-bit weight quantization (CPU or GPU), layer by layer"
    ),
    "gptq": _stage(
        "quantize.gptq",
        GPTQParams,
        "quantize.run:run_gptq",
        "GPTQ 4-bit weight quantization (CPU or GPU), layer by layer",
    ),
    "gguf": StageDef(
        "quantize.gguf",
        GGUFParams,
        "quantize.gguf_run:run_gguf",
        "llama.cpp GGUF (F16 and quantized types) and an Ollama Modelfile, checked against serve",
    ),
    "rtn": _stage(
        "quantize.rtn", RTNParams, "quantize.run:run_rtn", "round-to-nearest weight quantization (the baseline)"
    ),
}
