"""The per-layer pieces of the decoder forward: fused linears, norms, RoPE, one layer's weights.

Projections that share an input are fused at load (q|k|v and gate|up), dense or int4, so each
layer runs four matmuls. Norms run in float32 and round back as transformers does, so bf16
logits stay close to the HF reference. What differs between families (`serve.arch`) is decided
here at load: which norms a layer has, whether they multiply by `w` or `1 + w`, q/k norms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve import cpu_kernels
from serve.config import ModelConfig
from serve.quant import DenseLinear, Int4Linear, can_fuse, gptq_to_int4_parts

Linear = Callable[[torch.Tensor], torch.Tensor]


class SplitLinear:
    """Several linears on the same input whose outputs are concatenated (unfusable int4 parts)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the parts' outputs along the feature dim."""
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fused_linear(
    state: dict[str, torch.Tensor],
    names: list[str],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    int4_activations: str = "int8",
    triton_int4: bool = False,
) -> Linear:
    """One linear for projections sharing an input: concatenated dense weights or int4 parts
    (serve's AVX2 kernel and torch's int4 kernel on CPU, the Triton int4 GEMM off the CPU or
    when `triton_int4`: a model on the Triton attention backend, which on CPU runs under
    Triton's interpreter, so the CUDA engine's int4 path is testable there)."""
    biases = [state.get(f"{n}.bias") for n in names]
    bias = torch.cat([b.to(dtype) for b in biases]) if all(b is not None for b in biases) else None
    if f"{names[0]}.qweight" not in state:
        missing = [n for n in names if f"{n}.weight" not in state]
        if missing:
            raise KeyError(
                f"checkpoint lacks {missing[0]}.weight (nor a GPTQ qweight); is it one of the served families?"
            )
        return DenseLinear(torch.cat([state[f"{n}.weight"].to(dtype) for n in names]), bias)
    if config.quant is None:
        raise ValueError(
            f"{names[0]}.qweight found but config.json has no quantization_config; the checkpoint is inconsistent"
        )
    q = config.quant
    if torch.device(device).type != "cpu" or triton_int4:
        from serve.triton_int4 import Int4TritonLinear

        return SplitLinear(
            [
                Int4TritonLinear(
                    state[f"{n}.qweight"],
                    state[f"{n}.qzeros"],
                    state[f"{n}.scales"],
                    state.get(f"{n}.g_idx"),
                    q.group_size,
                    b.to(dtype) if b is not None else None,
                    q.checkpoint_format,
                )
                for n, b in zip(names, biases)
            ]
        )
    parts = [
        gptq_to_int4_parts(
            n,
            state[f"{n}.qweight"],
            state[f"{n}.qzeros"],
            state[f"{n}.scales"],
            state.get(f"{n}.g_idx"),
            q.group_size,
            q.checkpoint_format,
        )
        for n in names
    ]
    a8 = int4_activations == "int8"
    if can_fuse(parts):
        return Int4Linear(parts, bias, int8_activations=a8)
    return SplitLinear(
        [Int4Linear([p], b.to(dtype) if b is not None else None, int8_activations=a8) for p, b in zip(parts, biases)]
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded back to x's dtype before the weight (transformers' order).

    torch's fused `rms_norm` accumulates bf16 input in float32 and rounds once, which is
    bit-identical to transformers' upcast / normalise / downcast (tested), in one op instead of
    seven and without two dtype round trips per norm. On CPU, bf16 rows take serve's C++ version
    of the same formula (`cpu_kernels`): torch's fused norm still costs ~50 us per decode row.
    """
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.dim() == 1
        and x.device.type == "cpu"
        and cpu_kernels.available()
    ):
        return cpu_kernels.rms_norm_bf16(x, weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Norm:
    """RMSNorm over the last dim with a family's weight rule.

    Plain (`w`): normalise in float32, round to x's dtype, then multiply by w (Llama, Qwen).
    Plus-one (`1 + w`, Gemma): normalise and multiply in float32, round once; the float32
    `1 + w` is computed at load. A weight of shape [heads, head_dim] normalises each head of
    x [T, heads, head_dim] with its own row (q and k norms fused into one call).
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, plus_one: bool, dtype: torch.dtype, prepared: bool = False
    ) -> None:
        """`prepared`: `weight` is already in its final form (another Norm's `weight`)."""
        self.eps, self.plus_one = eps, plus_one
        if prepared:
            self.weight = weight
        else:
            self.weight = (1.0 + weight.float()) if plus_one else weight.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised x in x's dtype (bf16 rows on the CPU: serve's kernel, the same formula in one call)."""
        if self.plus_one:
            if x.dtype == torch.bfloat16 and x.device.type == "cpu" and cpu_kernels.available():
                return cpu_kernels.rms_norm_bf16_scaled(x, self.weight, self.eps)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def add_norm(
    x: torch.Tensor, y: torch.Tensor, out_norm: Norm | None, next_norm: Norm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step between branches: x + out_norm(y) (y where there is no such norm) and
    next_norm of that sum (None where `next_norm` is None: the last layer, whose final norm reads
    only the rows that sample).

    bf16 rows on the CPU take serve's kernel, one pass over each row with torch's roundings
    (`cpu_kernels.add_rms_norm_bf16`, the same bits as the three calls); elsewhere the calls.
    """
    fused = x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16 and x.device.type == "cpu"
    fused = fused and x.shape == y.shape and cpu_kernels.available()
    fused = fused and (out_norm is None or (out_norm.plus_one and out_norm.weight.dim() == 1))
    fused = fused and (next_norm is None or next_norm.weight.dim() == 1)
    eps = {n.eps for n in (out_norm, next_norm) if n is not None}
    if fused and len(eps) <= 1:
        w_y = out_norm.weight if out_norm is not None else None
        w_x = next_norm.weight if next_norm is not None else None
        if w_x is None or w_x.dtype in (torch.float32, torch.bfloat16):
            return cpu_kernels.add_rms_norm_bf16(x, y, w_y, w_x, eps.pop() if eps else 1e-6)
    x = x + (y if out_norm is None else out_norm(y))
    return x, (None if next_norm is None else next_norm(x))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate activation of the MLP: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) * up from the fused gate|up projection's rows [T, 2I] (gate first): the MLP's middle.

    bf16 rows on the CPU take serve's kernel (one pass; torch's bf16 GELU alone cost about 8 ms
    of a mixed serving step on Gemma 3 270M), except SiLU under the kernels' avx2 variant, where
    torch's own is as fast (576 x 2048: 1.5-1.8 ms against 2.0, forced to AVX2 on the same host);
    anything else runs `activation(name)` in torch.
    """
    act, gelu = activation(name), name == "gelu_pytorch_tanh"

    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        cpu_bf16 = gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu"
        takes = cpu_bf16 and gate_up.dim() == 2 and gate_up.stride(1) == 1 and cpu_kernels.available()
        if takes and (gelu or cpu_kernels.isa() != "avx2"):
            return cpu_kernels.gated_act_bf16(gate_up, gelu)
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return gated


@dataclass
class LayerWeights:
    """One decoder layer: fused projections, its norms and its attention window."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: Norm
    pre_mlp_norm: Norm
    attn_out_norm: Norm | None  # Gemma's post_attention_layernorm (on the attention output)
    mlp_out_norm: Norm | None  # Gemma's post_feedforward_layernorm
    qk_norm: Norm | None  # per-head q norm rows then k norm rows, [heads + kv_heads, head_dim]
    window: int | None  # sliding window; None for full attention


def load_layer(
    state: dict[str, torch.Tensor],
    i: int,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    int4_activations: str,
    triton_int4: bool = False,
) -> LayerWeights:
    """Fuse layer `i`'s projections and read its norms by the family's names."""
    p = f"model.layers.{i}."
    fam, eps = config.family, config.rms_norm_eps

    def lin(names: list[str]) -> Linear:
        return fused_linear(state, [p + n for n in names], config, dtype, device, int4_activations, triton_int4)

    def norm(name: str) -> Norm:
        key = f"{p}{name}.weight"
        if key not in state:
            raise KeyError(f"checkpoint lacks {key}, which a {fam.name} layer has")
        return Norm(state[key], eps, fam.norm_plus_one, dtype)

    qk_norm = None
    if fam.qk_norm:
        q, k = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        rows = torch.cat([q.weight.expand(config.num_heads, -1), k.weight.expand(config.num_kv_heads, -1)])
        qk_norm = Norm(rows.contiguous(), eps, fam.norm_plus_one, dtype, prepared=True)
    return LayerWeights(
        qkv=lin(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        o=lin(["self_attn.o_proj"]),
        gate_up=lin(["mlp.gate_proj", "mlp.up_proj"]),
        down=lin(["mlp.down_proj"]),
        input_norm=norm("input_layernorm"),
        pre_mlp_norm=norm("pre_feedforward_layernorm" if fam.sandwich_norms else "post_attention_layernorm"),
        attn_out_norm=norm("post_attention_layernorm") if fam.sandwich_norms else None,
        mlp_out_norm=norm("post_feedforward_layernorm") if fam.sandwich_norms else None,
        qk_norm=qk_norm,
        window=config.layer_windows[i],
    )
