"""Qwen 3 and Gemma 3 (sliding window, mixed layer types) against transformers, in float32.

Tiny random checkpoints built in-process: logits at every position within 1e-4, greedy
generation token-identical to `generate`, through the whole engine (chunked prefill, prefix
caching, speculative decoding with a draft of the same family).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams
from serve.config import ModelConfig
from serve.model import DecoderModel
from tests.serve.conftest import hf_model, make_layer_skip_draft, make_model
from warsha.random_models import FAMILY_CONFIGS


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint of each new family (Mistral: its window is now real)."""
    return make_model(tmp_path_factory.mktemp(request.param), seed=5, **FAMILY_CONFIGS[request.param])


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers_at_every_position(family_dir: Path) -> None:
    """70 tokens: more than four windows of 16, so sliding layers mask most of the context."""
    ours = DecoderModel.load(family_dir, "float32")
    ids = [1] + _ids(69, ours.config.vocab_size)
    with torch.no_grad():
        ref = hf_model(family_dir)(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.prefill_logits(ids, block_size=8), ref, rtol=1e-4, atol=1e-4)


def test_greedy_matches_generate_through_the_engine(family_dir: Path) -> None:
    """Chunked prefill (budget 24 < prompt) and decode past the window, several prompts at once."""
    ref_model = hf_model(family_dir)
    llm = LLM(family_dir, dtype="float32", block_size=4, max_num_batched_tokens=24, num_kv_blocks=160)
    prompts = [[1] + _ids(n, llm.config.vocab_size, seed=n) for n in (5, 30, 47)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
    llm.block_manager.check_no_leaks()


def test_prefix_caching_and_speculation_stay_exact(family_dir: Path, tmp_path: Path) -> None:
    """A shared 40-token prefix (past the window) hits the cache; a layer-skip draft of the same
    family (its first layers) speculates; greedy outputs equal the plain engine's."""
    layers = ModelConfig.from_dir(family_dir).num_layers
    draft = make_layer_skip_draft(family_dir, tmp_path / "draft", num_layers=min(3, layers - 1))
    plain = LLM(family_dir, dtype="float32", block_size=4, num_kv_blocks=200, enable_prefix_caching=False)
    vocab = plain.config.vocab_size
    shared = [1] + _ids(40, vocab, seed=9)
    prompts = [shared + _ids(k, vocab, seed=k) for k in (3, 6, 9)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    fast = LLM(family_dir, draft_dir=draft, dtype="float32", block_size=4, num_kv_blocks=200, num_speculative_tokens=3)
    got = [o.token_ids for o in fast.generate([prompts[0]], params)]
    got += [o.token_ids for o in fast.generate(prompts[1:], params)]
    assert got == want
    assert fast.scheduler.prefix_hit_tokens > 0
    fast.block_manager.check_no_leaks()


def test_unknown_family_is_refused_with_the_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2, qwen3, gemma3_text"):
        ModelConfig.from_dict({"model_type": "phi3", "num_attention_heads": 4, "hidden_size": 64}, "x/config.json")


def _gptq_pair(base: Path, out: Path) -> tuple[Path, Path]:
    """(GPTQ int4 checkpoint of `base`, float32 checkpoint of exactly its dequantized weights)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.serve.gptq_pack import brute_force_dequant, quantize_to_gptq

    qdir, ddir = out / "q", out / "deq"
    qstate, dstate = {}, {}
    for name, tensor in load_file(str(base / "model.safetensors")).items():
        module = name[: -len(".weight")]
        if name.endswith("_proj.weight"):
            packed = quantize_to_gptq(tensor, 32, act_order="k_proj" in name, seed=len(name))
            qstate.update({f"{module}.{k}": v for k, v in packed.items()})
            dstate[name] = brute_force_dequant(packed)
        else:
            qstate[name] = dstate[name] = tensor
    cfg = json.loads((base / "config.json").read_text())
    for d, qc in ((ddir, None), (qdir, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False})):
        d.mkdir(parents=True)
        shutil.copy(base / "tokenizer.json", d / "tokenizer.json")
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    save_file(qstate, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dstate, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    return qdir, ddir


def test_gptq_int4_checkpoint_loads_and_matches_its_dequantized_weights(family_dir: Path, tmp_path: Path) -> None:
    """Every projection int4 (AVX2/torch int4 kernels, float activations) vs transformers on the
    dequantized float32 weights: the families' norms and head_dim reach the int4 path intact."""
    qdir, ddir = _gptq_pair(family_dir, tmp_path)
    ours = DecoderModel.load(qdir, "float32", int4_activations="float")
    ids = [1] + _ids(39, ours.config.vocab_size)
    with torch.no_grad():
        want = hf_model(ddir)(torch.tensor([ids])).logits[0].float()
    got = ours.prefill_logits(ids, block_size=8)
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.slow
def test_triton_backend_serves_sliding_windows(tmp_path: Path) -> None:
    """Gemma 3 through the Triton kernels (interpreter on CPU, minutes): prefill logits and a
    greedy decode past the window equal transformers'. The kernels' windows are checked fast in
    test_triton_attention."""
    from serve.attention import get_backend

    path = make_model(tmp_path / "g", seed=5, **FAMILY_CONFIGS["gemma3"])
    ours = DecoderModel.load(path, "float32", backend=get_backend("cpu", prefer="triton"))
    ids = [1] + _ids(39, ours.config.vocab_size)
    ref = hf_model(path)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.prefill_logits(ids, block_size=8), want, rtol=1e-4, atol=1e-4)
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, attention_backend="triton")
    out = llm.generate([ids[:20]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids[:20]]), max_new_tokens=8, do_sample=False)[0, 20:].tolist()
    assert out.token_ids == expected
