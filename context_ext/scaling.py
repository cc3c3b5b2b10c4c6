"""Reading and writing RoPE scaling in ``config.json`` the way transformers 5 and vLLM read it.

What each loader derives from the file (transformers 5.23 ``modeling_rope_utils``; vLLM
``_get_and_verify_max_len`` and ``get_rope``):

- transformers reads ``rope_parameters = {rope_type, factor, original_max_position_embeddings,
  rope_theta, ...}`` (the legacy ``rope_scaling`` dict is converted on load). It never derives
  a length from the factor; for ``yarn`` it warns when max/original differs from the factor,
  and ``dynamic`` measures growth from ``max_position_embeddings``.
- vLLM derives the serving length as ``original_max_position_embeddings * factor`` for yarn,
  but as ``min(max_position_embeddings, tokenizer model_max_length) * factor`` for linear and
  dynamic: it multiplies by the factor itself, after the tokenizer cap.

So that every loader arrives at ``original * factor`` exactly once, this module writes:

- yarn: ``max_position_embeddings = original * factor`` (transformers checks max/original
  against the factor; vLLM reads the original from rope_parameters);
- static NTK: plain RoPE with the enlarged ``rope_theta`` (every engine reads that alike; no
  engine-specific rope type) and ``max_position_embeddings = original * factor``;
- linear and dynamic NTK: ``max_position_embeddings`` stays the original length, because the
  loaders multiply it by the factor themselves (writing original * factor there is how vLLM
  ends up serving original * factor^2), and dynamic NTK measures its growth from it.

tokenizer_config.json's ``model_max_length`` becomes ``original * factor`` in every case.

A ``warsha_context_ext`` record keeps the original length, theta and factor so that a second
run refuses to scale twice (or composes the factors when asked to).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from serve import rope

Method = Literal["yarn", "linear", "ntk"]
RECORD_KEY = "warsha_context_ext"
# Architectures whose configs may omit every RoPE key (old checkpoints) yet use RoPE.
ROPE_MODEL_TYPES = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo",
    "olmo2",
    "starcoder2",
    "stablelm",
    "granite",
    "cohere",
    "internlm2",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_neox",
    "falcon",
    "exaone",
    "smollm3",
}
GLOBAL_LAYER = "full_attention"
YARN_OPTIONS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True)
class RopeState:
    """What a config says about its rotary embeddings, normalised across config generations."""

    model_type: str
    head_dim: int
    theta: float
    rope_type: str
    factor: float
    original: int
    max_position_embeddings: int
    params: dict[str, Any]
    record: dict[str, Any] | None

    @property
    def scaled(self) -> bool:
        """True when the config already extends its context (by any method)."""
        return self.record is not None or self.rope_type != "default"


def architecture(cfg: dict[str, Any]) -> str:
    """A readable name for error messages: the class and the model type."""
    arch = (cfg.get("architectures") or ["?"])[0]
    return f"{arch} (model_type {cfg.get('model_type', '?')!r})"


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE dict in either the transformers-5 or the legacy layout, or None if no RoPE."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    has_rope = params is not None or "rope_theta" in cfg or cfg.get("model_type") in ROPE_MODEL_TYPES
    if not has_rope:
        return None
    out = dict(params or {})
    if any(isinstance(v, dict) for v in out.values()):
        out = _global_entry(cfg, out)
    out.setdefault("rope_type", out.pop("type", "default"))
    out.pop("type", None)
    out.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg:
        out.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return out


def _global_entry(cfg: dict[str, Any], nested: dict[str, Any]) -> dict[str, Any]:
    """The full-attention entry of per-layer-type rope_parameters (Gemma 3: local sliding
    layers keep their own short-range base and are never scaled; only the global layers, the
    ones that see the whole context, carry the extension)."""
    if GLOBAL_LAYER not in nested or not isinstance(nested[GLOBAL_LAYER], dict):
        raise ValueError(
            f"config.json: {architecture(cfg)} has per-layer rope_parameters ({', '.join(nested)})"
            f" without a {GLOBAL_LAYER!r} entry; context_ext scales the full-attention layers' RoPE only"
        )
    return dict(nested[GLOBAL_LAYER])


def per_layer(cfg: dict[str, Any]) -> bool:
    """Whether the config keeps one RoPE dict per layer type (``full_attention``, ...)."""
    params = cfg.get("rope_parameters") or {}
    return any(isinstance(v, dict) for v in params.values())


def read_state(cfg: dict[str, Any]) -> RopeState:
    """Parse a config dict; ``ValueError`` naming the architecture if it has no RoPE."""
    params = _rope_params(cfg)
    if params is None:
        raise ValueError(
            f"config.json: {architecture(cfg)} has no rotary position embeddings (no rope_theta,"
            " rope_parameters or rope_scaling); context_ext extends RoPE models only"
            " (Llama, Mistral, Qwen, Gemma, ...)"
        )
    if "max_position_embeddings" not in cfg:
        raise ValueError(f"config.json: {architecture(cfg)} has no max_position_embeddings")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    record = cfg.get(RECORD_KEY)
    max_pos = int(cfg["max_position_embeddings"])
    kind = params["rope_type"]
    factor = float(params.get("factor") or 1.0)
    original = int(params.get("original_max_position_embeddings") or max_pos)
    theta = float(params["rope_theta"])
    if record:
        factor, original = float(record["factor"]), int(record["original_max_position_embeddings"])
        theta = float(record["original_rope_theta"])
    return RopeState(cfg.get("model_type", "?"), int(head_dim), theta, kind, factor, original, max_pos, params, record)


def _previous_method(state: RopeState) -> str:
    if state.record:
        return "ntk" if state.record["method"] == "ntk" else str(state.record["method"])
    return {"dynamic": "ntk"}.get(state.rope_type, state.rope_type)


def plan(state: RopeState, method: Method, factor: float, original: int | None, compose: bool) -> tuple[float, int]:
    """The total factor and original length to write; refuses to scale a scaled config twice."""
    if factor <= 1:
        raise ValueError(f"factor: must be > 1, got {factor}")
    if not state.scaled:
        return factor, int(original or state.max_position_embeddings)
    described = f"rope_type {state.rope_type!r}, factor {state.factor:g}, original length {state.original}"
    if not compose:
        raise ValueError(
            f"config.json is already scaled ({described}); scaling it again would apply a factor"
            " twice. Start from the unscaled model, or set compose: true to multiply the factors"
            " explicitly"
        )
    if _previous_method(state) != method:
        raise ValueError(
            f"compose: the config is scaled by {_previous_method(state)!r} ({described}); only the"
            f" same method composes with {method!r}. Start from the unscaled model instead"
        )
    if original is not None and original != state.original:
        raise ValueError(
            f"original_max_position_embeddings: {original} differs from the original length"
            f" {state.original} recorded in the already-scaled config; leave it unset with compose"
        )
    return state.factor * factor, state.original


def scaled_config(
    cfg: dict[str, Any],
    method: Method,
    factor: float,
    original: int | None = None,
    compose: bool = False,
    ntk_dynamic: bool = False,
    yarn_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A new config dict carrying the scaling; the input is not modified."""
    state = read_state(cfg)
    total, orig = plan(state, method, factor, original, compose)
    base = {"rope_theta": state.theta}
    if "partial_rotary_factor" in state.params:
        base["partial_rotary_factor"] = state.params["partial_rotary_factor"]
    out = copy.deepcopy(cfg)
    out.pop("rope_scaling", None)
    out.pop("rope_theta", None)
    length = int(round(orig * total))
    dim = rope.rotary_dim(state.head_dim, float(base.get("partial_rotary_factor", 1.0)))
    if method == "yarn":
        extra = {k: v for k, v in (yarn_options or {}).items() if v is not None}
        params = {"rope_type": "yarn", "factor": total, "original_max_position_embeddings": orig, **base, **extra}
    elif method == "linear":
        params = {"rope_type": "linear", "factor": total, **base}
        length = orig
    elif ntk_dynamic:
        params = {"rope_type": "dynamic", "factor": total, **base}
        length = orig
    else:
        params = {**base, "rope_type": "default", "rope_theta": rope.ntk_theta(state.theta, dim, total)}
    if per_layer(cfg):
        params = {**copy.deepcopy(cfg["rope_parameters"]), GLOBAL_LAYER: params}
    out["rope_parameters"] = params
    out["max_position_embeddings"] = length
    out[RECORD_KEY] = {
        "method": method,
        "factor": total,
        "original_max_position_embeddings": orig,
        "original_rope_theta": state.theta,
        "ntk_dynamic": bool(ntk_dynamic and method == "ntk"),
        "context_length": int(round(orig * total)),
    }
    return out


def serving_length(cfg: dict[str, Any]) -> int:
    """The context length the scaled config promises (original * factor), from its record."""
    record = cfg.get(RECORD_KEY)
    if record:
        return int(record["context_length"])
    return int(cfg["max_position_embeddings"])


def inv_freq_of(cfg: dict[str, Any], seq_len: int | None = None) -> tuple[Any, float]:
    """The frequencies a loader derives from this config (used to verify what was written)."""
    state = read_state(cfg)
    return rope.from_rope_parameters(state.params, state.head_dim, state.max_position_embeddings, seq_len)


def write_model_dir_config(model_dir: Path, cfg: dict[str, Any]) -> None:
    """Write config.json and cap tokenizer_config.json's ``model_max_length`` at the new length."""
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = json.loads(tok_cfg.read_text())
        data["model_max_length"] = serving_length(cfg)
        tok_cfg.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def unscaled_layers(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-layer-type RoPE entries the extension leaves as they were (Gemma 3's local layers)."""
    if not per_layer(cfg):
        return {}
    return {k: v for k, v in cfg["rope_parameters"].items() if k != GLOBAL_LAYER and isinstance(v, dict)}
