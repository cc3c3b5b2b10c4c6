"""The one-decoder-layer-at-a-time driver shared by RTN, GPTQ and AWQ.

Calibration tokens go through the embeddings once; the hidden states entering decoder layer 0
are caught, with the keyword arguments the model passes each type of layer (rotary embeddings,
mask: Gemma 3's sliding and full-attention layers get different ones).
Then for each layer: move it to the compute device, check its weights, let the method quantize
its linears (writing the fake-quantized weights back), rerun the *quantized* layer to get the
next layer's inputs, check them, move the layer back. Peak device memory is one decoder layer
plus the calibration activations, whatever the model size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from quantize.arch import ArchSpec, decoder_layers, get_module
from quantize.awq import AWQOptions, awq_layer
from quantize.gptq import GPTQOptions, HessianAccumulator, gptq_quantize
from quantize.quantizer import QuantizedLinear, QuantSpec, quantize_rtn
from quantize.shapes import layout_problem, summarize

log = logging.getLogger("warsha.quantize")


@dataclass
class Calibration:
    """Per-batch hidden states entering the current layer and the layer call's kwargs.

    Models with several attention layer types (Gemma 3: sliding and full) pass each type its own
    mask and rotary embeddings, so ``by_type`` keeps one kwargs list per type and ``select``
    points ``kwargs`` at the current layer's; a full-attention layer run with a sliding layer's
    RoPE would feed every later layer (and its Hessian) activations the model never produces."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]]
    by_type: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    layer_types: list[str] = field(default_factory=list)

    def select(self, index: int) -> None:
        """Make ``kwargs`` what the model passes decoder layer ``index``."""
        if self.layer_types:
            self.kwargs = self.by_type[self.layer_types[index]]


@dataclass
class Plan:
    """Which linears of each layer get quantized, and which were left in float (fallback)."""

    names: dict[int, list[str]]
    skipped: dict[str, str] = field(default_factory=dict)


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Stop with the tensor's name when it holds NaN or Inf."""
    if not torch.isfinite(tensor).all():
        kind = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise ValueError(f"quantize: {what} contains {kind}; fix the input model (or the compute dtype) first")


def check_model_finite(model: Any) -> None:
    """Every parameter and buffer, before any work starts."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point():
            check_finite(p.data, f"weight {name}")


def plan_layers(model: Any, arch: ArchSpec, spec: QuantSpec, fmt: str, on_bad_group: str) -> Plan:
    """Check every linear's shape up front: raise once per pattern of bad ones, or skip them."""
    plan = Plan(names={})
    bad: dict[tuple[int, str], str] = {}
    layers = decoder_layers(model, arch)
    for i, layer in enumerate(layers):
        plan.names[i] = []
        for name in arch.linears:
            fc = get_module(layer, name)
            problem = layout_problem(fc.in_features, fc.out_features, spec.bits, spec.group_size, fmt)
            if problem:
                bad[(i, name)] = problem
                plan.skipped[f"{arch.layers}.{i}.{name}"] = problem
            else:
                plan.names[i].append(name)
    if bad and on_bad_group == "error":
        raise ValueError(
            f"quantize: {len(bad)} linear(s) cannot be quantized: "
            + "; ".join(summarize(bad, len(layers)))
            + ". Choose a group_size that divides them (or auto), or set on_bad_group: fallback to keep them"
            " unquantized"
        )
    for line in summarize(bad, len(layers)):
        log.warning("quantize: stays unquantized: %s", line)
    return plan


class _Caught(Exception):
    pass


def layer_types(model: Any, num_layers: int) -> list[str]:
    """Each decoder layer's attention type from the config (one type when it names none)."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or getattr(getattr(cfg, "text_config", None), "layer_types", None)
    if not types or len(types) < num_layers:
        return ["default"] * num_layers
    return [str(t) for t in types[:num_layers]]


def capture_layer0(
    model: Any, arch: ArchSpec, ids: torch.Tensor, batch_size: int, device: str, dtype: torch.dtype
) -> Calibration:
    """Run the embeddings on every calibration batch and catch layer 0's inputs, and the
    kwargs of the first layer of each attention type (the pass stops at the last of those)."""
    layers = decoder_layers(model, arch)
    types = layer_types(model, len(layers))
    firsts = {kind: types.index(kind) for kind in dict.fromkeys(types)}
    last = max(firsts.values())
    calib = Calibration(hidden=[], kwargs=[], by_type={kind: [] for kind in firsts}, layer_types=types)

    def hook_for(kind: str, index: int) -> Callable[..., None]:
        def hook(_module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if index == 0:
                calib.hidden.append((args[0] if args else kwargs["hidden_states"]).to(dtype))
            calib.by_type[kind].append(kw)
            if index == last:
                raise _Caught

        return hook

    _move_non_layers(model, arch, device)
    for layer in layers[: last + 1]:
        layer.to(device)
    handles = [layers[i].register_forward_pre_hook(hook_for(k, i), with_kwargs=True) for k, i in firsts.items()]
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], batch_size):
                try:
                    model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)
                except _Caught:
                    pass
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers[: last + 1]:
            layer.to("cpu")
        _move_non_layers(model, arch, "cpu")
    for b, h in enumerate(calib.hidden):
        check_finite(h, f"the embedding output (calibration batch {b})")
    calib.select(0)
    return calib


def _move_non_layers(model: Any, arch: ArchSpec, device: str) -> None:
    if device == "cpu" and next(model.parameters()).device.type == "cpu":
        return
    parent = get_module(model, arch.layers.rsplit(".", 1)[0])
    for name, child in parent.named_children():
        if name != arch.layers.rsplit(".", 1)[1]:
            child.to(device)


Method = Callable[[Any, str, list[str], Calibration | None], dict[str, QuantizedLinear]]


def quantize_layers(
    model: Any, arch: ArchSpec, plan: Plan, method: Method, calib: Calibration | None, device: str, desc: str
) -> dict[str, QuantizedLinear]:
    """Apply ``method`` layer by layer; returns the quantized linears by full module name."""
    from warsha.progress import progress

    out: dict[str, QuantizedLinear] = {}
    layers = decoder_layers(model, arch)
    for i in progress(range(len(layers)), desc=desc, unit="layer"):
        layer = layers[i].to(device)
        prefix = f"{arch.layers}.{i}"
        for pname, p in layer.named_parameters():
            check_finite(p.data, f"weight {prefix}.{pname}")
        if calib is not None:
            calib.select(i)
        for name, ql in method(layer, prefix, plan.names[i], calib).items():
            out[f"{prefix}.{name}"] = ql.cpu()
        if calib is not None:
            with torch.no_grad():
                calib.hidden = [layer(h, **kw) for h, kw in zip(calib.hidden, calib.kwargs)]
            for b, h in enumerate(calib.hidden):
                check_finite(h, f"the output activations of {prefix} (calibration batch {b})")
        layers[i] = layer.to("cpu")
    return out


def rtn_method(spec: QuantSpec) -> Method:
    """Round each linear to nearest; needs no calibration."""

    def run(layer: Any, prefix: str, names: list[str], calib: Calibration | None) -> dict[str, QuantizedLinear]:
        del prefix, calib
        out = {}
        for name in names:
            fc = get_module(layer, name)
            ql = quantize_rtn(fc.weight.data, spec, None if fc.bias is None else fc.bias.data)
            fc.weight.data = ql.dequantize().to(fc.weight.device, fc.weight.dtype)
            out[name] = ql
        return out

    return run


def _forward_all(layer: Any, calib: Calibration) -> None:
    """Run the layer on every calibration batch; a hook may end a pass early with ``_Caught``."""
    with torch.no_grad():
        for h, kw in zip(calib.hidden, calib.kwargs):
            try:
                layer(h, **kw)
            except _Caught:
                pass


def _hessian_hook(acc: HessianAccumulator) -> Callable[[Any, tuple], None]:
    """Fold the linear's input into ``acc``, then stop the pass: nothing after it is needed.

    Why stop: the q/k/v step needs only the normed input, the gate/up step only the attention
    output; finishing the layer each time made GPTQ run about four full layer passes per layer.
    """

    def hook(_module: Any, args: tuple) -> None:
        acc.add(args[0])
        raise _Caught

    return hook


def gptq_method(arch: ArchSpec, spec: QuantSpec, opts: GPTQOptions) -> Method:
    """True-sequential GPTQ: each step's Hessian is measured after earlier steps were quantized."""

    def run(layer: Any, prefix: str, names: list[str], calib: Calibration | None) -> dict[str, QuantizedLinear]:
        assert calib is not None, "GPTQ needs calibration data"
        out = {}
        for step in arch.sequential:
            todo = [n for n in step if n in names]
            if not todo:
                continue
            first = get_module(layer, step[0])
            acc = HessianAccumulator(first.in_features, first.weight.device)
            handle = first.register_forward_pre_hook(_hessian_hook(acc))
            try:
                _forward_all(layer, calib)
            finally:
                handle.remove()
            check_finite(acc.h, f"the input activations of {prefix}.{step[0]}")
            for name in todo:
                fc = get_module(layer, name)
                bias = None if fc.bias is None else fc.bias.data
                ql = gptq_quantize(fc.weight.data, acc.h, spec, opts, f"{prefix}.{name}", bias)
                fc.weight.data = ql.dequantize().to(fc.weight.device, fc.weight.dtype)
                out[name] = ql
        return out

    return run


def awq_method(arch: ArchSpec, spec: QuantSpec, opts: AWQOptions, alphas: dict[str, float]) -> Method:
    """AWQ on inputs captured from one forward pass of the float layer."""

    def run(layer: Any, prefix: str, names: list[str], calib: Calibration | None) -> dict[str, QuantizedLinear]:
        assert calib is not None, "AWQ needs calibration data"
        captured: dict[str, list[torch.Tensor]] = {step[0]: [] for step in arch.sequential}
        attn_calls: list[tuple[tuple, dict[str, Any]]] = []
        handles = [
            get_module(layer, key).register_forward_pre_hook(
                lambda _m, args, key=key: captured[key].append(args[0].detach())
            )
            for key in captured
        ]
        attn = get_module(layer, arch.attention)
        handles.append(
            attn.register_forward_pre_hook(lambda _m, a, k: attn_calls.append((a, dict(k))), with_kwargs=True)
        )
        try:
            _forward_all(layer, calib)
        finally:
            for h in handles:
                h.remove()
        for key, xs in captured.items():
            for x in xs:
                check_finite(x, f"the input activations of {prefix}.{key}")

        def run_attention(x: torch.Tensor, b: int) -> torch.Tensor:
            args, kwargs = attn_calls[b]
            if "hidden_states" in kwargs:
                return attn(**{**kwargs, "hidden_states": x})[0]
            return attn(x, *args[1:], **kwargs)[0]

        out, found = awq_layer(layer, arch, spec, opts, captured, run_attention, names, prefix)
        alphas.update(found)
        return out

    return run
