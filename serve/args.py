"""`EngineArgs`: every option of the engine in one dataclass, checked before anything loads.

Each field carries its help text (and choices) in its metadata. `LLM(model_dir, draft_dir,
**kwargs)` builds one from keyword arguments; the HTTP server's flags are generated from the
fields (`EngineArgs.add_cli_args`, as vLLM's `EngineArgs.add_cli_args`) and read back with
`from_namespace`; `serve.validate` passes its recipe's `engine:` block to it. So the engine, the
server, the pipeline and the benchmarks share one list of options with one set of defaults and
one error per bad value. Torch-free, so `python -m serve --help` answers at once.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any

ENGINE_DTYPES = ("bfloat16", "float32")
DEVICES = ("cpu", "cuda")
INT4_ACTIVATIONS = ("int8", "float")
HEAD_QUANTS = ("none", "int8")
ATTENTION_BACKENDS = ("torch", "triton")


def option(default: Any, help: str, choices: tuple[Any, ...] | None = None, flag: str | None = None) -> Any:
    """A field with its server flag's help text, choices, and (for a switch) its negated flag.

    `flag="--no-x"` makes a boolean field a switch that stores False; every other field becomes
    `--field-name` taking a value of the field's type.
    """
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass(frozen=True)
class EngineArgs:
    """Options of one engine (target, optional draft, KV cache, scheduler, speculation).

    Every field's help says what it does (`python -m serve --help` prints them all).
    """

    dtype: str = option("bfloat16", "weight and KV dtype", ENGINE_DTYPES)
    draft_dtype: str | None = option(
        None,
        "the draft's weight and KV dtype; the draft only proposes, so its precision moves acceptance, never"
        " the output, and a bfloat16 draft reads half the bytes of a float32 one (default: --dtype)",
        ENGINE_DTYPES,
    )
    device: str = option("cpu", "cpu, or cuda (cuda:N) for Triton kernels on a GPU")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "exact number of KV blocks (overrides --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = option(1.0, "memory for the paged KV cache, GiB")
    max_model_len: int | None = option(None, "longest prompt + completion served (default: the model's)")
    max_num_seqs: int = option(64, "most requests in one batch")
    max_num_batched_tokens: int = option(512, "token budget of one step: prefill chunks + decodes")
    max_waiting: int = option(4096, "queue length beyond which new requests are refused (HTTP 429)")
    max_tokens_in_flight: int | None = option(
        None, "cap on the sum of prompt + max_tokens over queued and running requests; beyond it 429"
    )
    enable_prefix_caching: bool = option(
        True, "disable reuse of cached KV blocks across requests with a shared prefix", flag="--no-prefix-caching"
    )
    num_speculative_tokens: int = option(4, "draft tokens proposed per step with --draft or --prompt-lookup-max")
    adaptive_speculation: bool = option(
        True,
        "always speculate instead of letting each request draft the window its own acceptance pays for",
        flag="--no-adaptive-speculation",
    )
    cuda_graphs: bool = option(
        True,
        "on CUDA, run every decode step eagerly instead of replaying CUDA graphs captured per batch size"
        " (serve.decode_graphs; graphs need the Triton backend)",
        flag="--enforce-eager",
    )
    seed: int = option(0, "seed of the engine's default sampler (requests may pass their own seed)")
    draft_vocab_size: int | None = option(
        None,
        "the draft's head over its N most frequent ids of draft_vocab.json; 0 ignores the file"
        " (default: the file as written)",
    )
    attention_backend: str | None = option(
        None,
        "attention kernels (default: by device, torch on CPU, Triton on CUDA); triton on CPU runs only"
        " under TRITON_INTERPRET=1",
        ATTENTION_BACKENDS,
    )
    int4_activations: str = option(
        "int8",
        "int4 checkpoints on CPU: round decode activations to int8 per 32 features (about twice as fast)"
        " or keep them float32",
        INT4_ACTIVATIONS,
    )
    head_quant: str = option(
        "none",
        "int8: round the LM head (target and draft) to int8 per row on CPU (half the bytes a decode step reads"
        " for it; outputs may differ from the checkpoint's at near-ties); none: the checkpoint's head",
        HEAD_QUANTS,
    )
    head_screen: bool = option(
        True,
        "find every greedy decode step's token through the whole LM head instead of an int8 copy that"
        " bounds each logit and leaves the head's own kernel only the rows that can win (serve.head_screen:"
        " the same tokens; large bf16/float32 CPU heads, half the bytes; the copy costs half the bf16 head;"
        " greedy batches past 8 rows also use uint8 rows on AVX-512 VNNI CPUs, serve.head_screen_batch,"
        " with a packed second copy)",
        flag="--no-head-screen",
    )
    draft_head_quant: str = option(
        "auto",
        "the draft's LM head: int8 reads a quarter of float32's bytes per drafted token and moves only"
        " acceptance, never outputs; auto: int8 on CPU where serve's kernels run (as --head-quant int8"
        " always makes it), otherwise the checkpoint's",
        ("auto", *HEAD_QUANTS),
    )
    prompt_lookup_max: int = option(
        0,
        "draft by prompt lookup: copy what followed the latest earlier occurrence of the last N tokens"
        " (N from this down to --prompt-lookup-min); with --draft, the draft model drafts where nothing is"
        " found. Pays on repetitive text (quoting the prompt, lists, code, greedy loops). 0: off",
    )
    prompt_lookup_min: int = option(2, "shortest suffix a prompt lookup may match")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid option, each naming the field and what would fix it."""
        out = [p for f in fields(self) if (p := _choice_problem(f, getattr(self, f.name)))]
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            out.append(f"device={self.device!r} is not supported; use cpu or cuda")
        if self.head_quant == "int8" and self.device != "cpu":
            out.append(f"head_quant='int8' runs on the CPU only (device={self.device!r}); use head_quant='none'")
        if self.draft_head_quant == "int8" and self.device != "cpu":
            out.append(f"draft_head_quant='int8' runs on the CPU only (device={self.device!r}); use auto or none")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 1:
            out.append(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.prompt_lookup_max < 0 or self.prompt_lookup_min < 1:
            out.append(
                f"prompt_lookup_max={self.prompt_lookup_max}, prompt_lookup_min={self.prompt_lookup_min}:"
                " use prompt_lookup_max >= 0 (0: off) and prompt_lookup_min >= 1"
            )
        elif self.prompt_lookup_max and self.prompt_lookup_min > self.prompt_lookup_max:
            out.append(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max};"
                " lower the minimum or raise the maximum"
            )
        if self.num_kv_blocks is None and not self.kv_cache_memory_gb > 0:
            out.append(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            out.append(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            out.append(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        return out

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """One flag per field: `--field-name` of the field's type, default, choices and help;
        a boolean field with a `flag` in its metadata is that negated switch (`--no-...`)."""
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            meta = f.metadata
            if meta.get("flag"):
                parser.add_argument(meta["flag"], dest=f.name, action="store_false", help=meta["help"])
                continue
            shown = f.default is None or "(default:" in meta["help"]  # None: the help says what happens
            help_text = meta["help"] if shown else meta["help"] + " (default: %(default)s)"
            parser.add_argument(
                cli_flag(f),
                dest=f.name,
                type=_value_type(hints[f.name]),
                default=f.default,
                choices=meta.get("choices"),
                help=help_text,
            )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        """Options from parsed flags (`add_cli_args`): every field whose name is an attribute of `ns`."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def cli_flag(f: Field[Any]) -> str:
    """The server flag of field `f`: its switch (`--no-prefix-caching`) or `--field-name`."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _value_type(hint: Any) -> type:
    """`int` for `int | None` and the like: what argparse converts a flag's text with."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _choice_problem(f: Field[Any], value: Any) -> str | None:
    """`name=value; use one of ...` when the field has choices and `value` is none of them."""
    choices = f.metadata.get("choices")
    if choices is None or value in choices or (value is None and f.default is None):
        return None
    return f"{f.name}={value!r} is not supported; use one of {', '.join(choices)}"
