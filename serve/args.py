"""`EngineArgs`: every option of the engine in one dataclass, checked before anything loads.

`LLM(model_dir, draft_dir, **kwargs)` builds one from its keyword arguments, and the HTTP
server builds one from its flags (`EngineArgs.from_namespace`), so the engine, the server and
the benchmarks share one list of options with one set of defaults and one error per bad value.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from serve.head_quant import HEAD_QUANTS

ENGINE_DTYPES = ("bfloat16", "float32")
DEVICES = ("cpu", "cuda")
INT4_ACTIVATIONS = ("int8", "float")


@dataclass(frozen=True)
class EngineArgs:
    """Options of one engine (target, optional draft, KV cache, scheduler, speculation).

    `num_kv_blocks` overrides the `kv_cache_memory_gb` budget. `draft_vocab_size`: None uses
    the draft's `draft_vocab.json` as written, N keeps its N most frequent ids, 0 ignores the
    file. `attention_backend`: None picks by device (torch on CPU, Triton on CUDA); "triton"
    on CPU runs only under TRITON_INTERPRET=1. `int4_activations`: how int4 checkpoints
    multiply small batches on CPU ("int8": activations rounded per 32 features; "float").
    `head_quant`: "int8" rounds the LM head (target and draft) to int8 per row on CPU
    (`serve.head_quant`); "none" serves the checkpoint's head. `draft_dtype`: the draft's weight
    and KV dtype (None: `dtype`); the draft only proposes, so its precision moves acceptance,
    never the output, and a bfloat16 draft reads half the bytes of a float32 one.
    `draft_head_quant`: the draft's LM head, "auto" (int8 on CPU where serve's kernels run, as
    `head_quant="int8"` always makes it; otherwise the checkpoint's), "int8" or "none". Like
    `draft_dtype` it moves acceptance only: every drafted token is verified by the target.
    `prompt_lookup_max` > 0 drafts by prompt lookup (`serve.prompt_lookup`): the tokens that
    followed the latest earlier occurrence of the request's last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens; with a draft model, the model drafts where no lookup is found.
    """

    dtype: str = "bfloat16"
    draft_dtype: str | None = None
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 4096
    max_tokens_in_flight: int | None = None
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 4
    adaptive_speculation: bool = True
    seed: int = 0
    draft_vocab_size: int | None = None
    attention_backend: str | None = None
    int4_activations: str = "int8"
    head_quant: str = "none"
    draft_head_quant: str = "auto"
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid option, each naming the field and what would fix it."""
        out = []
        if self.dtype not in ENGINE_DTYPES:
            out.append(f"dtype={self.dtype!r} is not supported; use one of {', '.join(ENGINE_DTYPES)}")
        if self.draft_dtype is not None and self.draft_dtype not in ENGINE_DTYPES:
            out.append(f"draft_dtype={self.draft_dtype!r} is not supported; use one of {', '.join(ENGINE_DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            out.append(f"device={self.device!r} is not supported; use cpu or cuda")
        if self.int4_activations not in INT4_ACTIVATIONS:
            out.append(f"int4_activations={self.int4_activations!r}; use one of {', '.join(INT4_ACTIVATIONS)}")
        if self.head_quant not in HEAD_QUANTS:
            out.append(f"head_quant={self.head_quant!r}; use one of {', '.join(HEAD_QUANTS)}")
        elif self.head_quant == "int8" and self.device != "cpu":
            out.append(f"head_quant='int8' runs on the CPU only (device={self.device!r}); use head_quant='none'")
        if self.draft_head_quant not in ("auto", *HEAD_QUANTS):
            out.append(f"draft_head_quant={self.draft_head_quant!r}; use one of auto, {', '.join(HEAD_QUANTS)}")
        elif self.draft_head_quant == "int8" and self.device != "cpu":
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
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        """Options from parsed server flags: every field whose name is an attribute of `ns`,
        plus the two negated switches (`--no-prefix-caching`, `--no-adaptive-speculation`)."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        values["enable_prefix_caching"] = not getattr(ns, "no_prefix_caching", False)
        values["adaptive_speculation"] = not getattr(ns, "no_adaptive_speculation", False)
        return cls(**values)
