"""The layer-by-layer driver feeds each decoder layer what the model itself feeds it.

Gemma 3 passes its sliding layers a windowed mask and a local RoPE and its full-attention layers
a causal mask and a global RoPE; the reference is the model's own forward, observed with hooks."""

from __future__ import annotations

from typing import Any

import torch

from quantize.arch import arch_for, decoder_layers
from quantize.layerwise import Calibration, Plan, capture_layer0, layer_types, quantize_layers
from tests.gemma3_tiny import gemma3_config


def _model_layer_io(model: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each decoder layer's input and output hidden states in the model's own forward."""
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(lambda _m, a, k: ins.append(_hidden(a, k)), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda _m, _a, o: outs.append(_first(o))))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return ins, outs


def _hidden(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    return (args[0] if args else kwargs["hidden_states"]).clone()


def _first(output: Any) -> torch.Tensor:
    return (output[0] if isinstance(output, tuple) else output).clone()


def test_each_layer_type_gets_its_own_mask_and_rope() -> None:
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config(300, num_hidden_layers=7)).eval()
    assert layer_types(model, 7) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    ids = torch.randint(5, 300, (4, 80))  # longer than the sliding window (32)
    ref_in, ref_out = _model_layer_io(model, ids)
    arch = arch_for(model.config.model_type)
    calib = capture_layer0(model, arch, ids, 2, "cpu", torch.float32)
    seen: list[torch.Tensor] = []

    def record(_layer: Any, _prefix: str, _names: list[str], c: Calibration | None) -> dict[str, Any]:
        assert c is not None
        seen.append(torch.cat(c.hidden))
        return {}

    n = len(decoder_layers(model, arch))
    quantize_layers(model, arch, Plan(names={i: [] for i in range(n)}), record, calib, "cpu", "check")
    for i in range(n):
        torch.testing.assert_close(seen[i], ref_in[i], msg=f"input of layer {i} ({layer_types(model, n)[i]})")
    torch.testing.assert_close(torch.cat(calib.hidden), ref_out[-1])


def test_models_without_layer_types_have_one_type() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    model = LlamaForCausalLM(cfg)
    assert len(set(layer_types(model, 2))) == 1
