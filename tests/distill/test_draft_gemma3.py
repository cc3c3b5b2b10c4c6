"""Drafts of a Gemma 3 target: same class, same tokenizer, layer types and tie kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distill import draft as drafting
from tests.gemma3_tiny import gemma3_config


@pytest.fixture(scope="module")
def gemma_target() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    return Gemma3ForCausalLM(gemma3_config(300)).eval()


def test_full_layer_subset_reproduces_gemma3(gemma_target: torch.nn.Module) -> None:
    d = drafting.layer_subset(gemma_target, list(range(6))).eval()
    assert type(d).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(5, 300, (1, 70))  # longer than the sliding window (32)
    with torch.inference_mode():
        torch.testing.assert_close(d(input_ids=ids).logits, gemma_target(input_ids=ids).logits)


def test_layer_subset_keeps_layer_types_and_tie(gemma_target: torch.nn.Module) -> None:
    d = drafting.layer_subset(gemma_target, [0, 5])
    assert d.config.layer_types == ["sliding_attention", "full_attention"]
    assert d.config.rope_parameters == gemma_target.config.rope_parameters
    assert d.get_input_embeddings().weight.data_ptr() == d.get_output_embeddings().weight.data_ptr()
    ts, ds = gemma_target.state_dict(), d.state_dict()
    for name, value in ds.items():
        assert torch.equal(value, ts[name.replace("model.layers.1.", "model.layers.5.")]), name


def test_narrow_gemma3_draft_saves_and_loads(gemma_target: torch.nn.Module, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    d = drafting.from_config(gemma_target, 32, 64, 2, 2, 1, "embedding")
    assert type(d).__name__ == "Gemma3ForCausalLM"
    assert d.config.layer_types == ["sliding_attention", "full_attention"]
    assert d.config.head_dim == 16 and d.config.query_pre_attn_scalar == 16
    assert d.config.vocab_size == gemma_target.config.vocab_size
    assert d.config.tie_word_embeddings
    d.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(5, 300, (1, 20))
    with torch.inference_mode():
        torch.testing.assert_close(back(input_ids=ids).logits, d.eval()(input_ids=ids).logits)
    assert drafting.narrow_layer_types(["sliding_attention"] * 5 + ["full_attention"], 1) == ["full_attention"]


def test_restricted_head_gives_the_full_logits_at_its_ids(gemma_target: torch.nn.Module) -> None:
    """With final-logit soft-capping on, as the model's own forward applies it."""
    import copy

    from distill.draft_vocab import restrict_head, with_full_head

    full = copy.deepcopy(gemma_target)
    full.config.final_logit_softcapping = 5.0
    ids = [7, 3, 250, 41, 0, 299]
    small = copy.deepcopy(full)
    restrict_head(small, ids)
    assert not small.get_input_embeddings().weight.requires_grad
    assert not small.get_output_embeddings().weight.requires_grad
    x = torch.randint(5, 300, (2, 40))
    with torch.inference_mode():
        torch.testing.assert_close(small(input_ids=x).logits, full(input_ids=x).logits[..., ids])
    with torch.no_grad():
        small.model.layers[1].mlp.up_proj.weight.add_(0.5)
    back = with_full_head(small, full)
    assert back.get_input_embeddings().weight.data_ptr() == back.get_output_embeddings().weight.data_ptr()
    assert torch.equal(back.model.layers[1].mlp.up_proj.weight, small.model.layers[1].mlp.up_proj.weight)
    with torch.inference_mode():
        torch.testing.assert_close(back(input_ids=x).logits[..., ids], small(input_ids=x).logits)


def test_masked_draft_acceptance_matches_brute_force(gemma_target: torch.nn.Module) -> None:
    """Acceptance of the served (restricted) draft: sum over the kept ids of min(p, q_kept)."""
    from distill.draft_vocab import mask_outside
    from warsha.speculative import analytic_acceptance

    draft = drafting.layer_subset(gemma_target, [0, 5]).eval()
    ids = list(range(0, 300, 3))
    seqs = [torch.randint(5, 300, (30,)).tolist() for _ in range(3)]
    got = analytic_acceptance(gemma_target, mask_outside(draft, ids), seqs, (1.0,), bf16=False)
    total = 0.0
    with torch.inference_mode():
        for s in seqs:
            x = torch.tensor([s])
            p = torch.softmax(gemma_target(input_ids=x).logits[0].double(), -1)
            q = torch.softmax(draft(input_ids=x).logits[0].double()[:, ids], -1)
            total += float(torch.minimum(p[:, ids], q).sum())
    assert got["t1"] == pytest.approx(total / 90, rel=1e-5)


def test_masked_view_multiplies_only_served_rows(gemma_target: torch.nn.Module) -> None:
    """The served view's logits are the full model's at the ids (soft-capped, with a KV cache)
    and -inf elsewhere; its head has only those rows; the model keeps its own head."""
    from transformers import DynamicCache

    from distill.draft_vocab import mask_outside

    draft = drafting.layer_subset(gemma_target, [0, 5]).eval()
    draft.config.final_logit_softcapping = 5.0
    ids = [7, 3, 250, 11, 42]
    view = mask_outside(draft, ids)
    head = draft.get_output_embeddings()
    assert view.head.weight.shape == (len(ids), head.weight.shape[1])
    x = torch.randint(5, 300, (2, 12))
    with torch.inference_mode():
        full = draft(input_ids=x).logits
        got = view(input_ids=x).logits
        cache = DynamicCache()
        view(input_ids=x[:1, :-1], past_key_values=cache, use_cache=True)
        step = view(input_ids=x[:1, -1:], past_key_values=cache, use_cache=True).logits
    assert draft.get_output_embeddings() is head
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    torch.testing.assert_close(got[..., ids], full[..., ids])
    assert bool(torch.isneginf(got[..., outside]).all())
    torch.testing.assert_close(step[0, -1, ids], full[0, -1, ids], atol=1e-5, rtol=1e-5)
    assert float(full.abs().max()) <= 5.0
