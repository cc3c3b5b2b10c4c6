"""The fused LM head + cross-entropy against float64 torch and transformers' own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from warsha import lm_loss
from warsha.lm_loss import causal_lm_loss, linear_cross_entropy, weighted_lm_loss


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    nll = F.cross_entropy(h @ w.t(), t, reduction="none")
    return (nll * wt).sum() / wt.sum()


def _inputs(n: int, hidden: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    t = torch.randint(0, vocab, (n,), generator=g)
    wt = torch.rand(n, generator=g) * 3  # weights above 1 (a passkey's answer) and near 0
    wt[::5] = 0.0
    return h, w, t, wt


@pytest.mark.parametrize("chunk_elements", [1 << 26, 7 * 50, 50])  # one chunk; uneven chunks; a row each
def test_loss_and_gradients_match_float64(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", chunk_elements)
    h, w, t, wt = _inputs(23, 16, 50)
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    got = linear_cross_entropy(h32, w32, t, wt)
    ref = _reference(h64, w64, t, wt.double())
    (got * 2.5).backward()  # a non-unit upstream gradient reaches both inputs
    (ref * 2.5).backward()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
    assert h32.grad[::5].abs().sum() == 0  # weight-0 rows get no gradient


def test_targets_far_below_the_peak_keep_an_exact_loss() -> None:
    """A target whose float32 probability underflows to 0 (logit 150+ below the row's peak) still
    gets its true loss and gradient: the normaliser is read at the peak, never at the target."""
    h, w, t, wt = _inputs(11, 16, 50, seed=3)
    h = h * 80  # logit ranges of several hundred
    logits = h.double() @ w.double().t()
    t = logits.argmin(-1)  # every target the least likely token
    assert (logits.amax(-1) - logits.gather(1, t[:, None]).squeeze(1)).min() > 150
    h32, h64 = h.clone().requires_grad_(), h.double().requires_grad_()
    got = linear_cross_entropy(h32, w, t, wt)
    ref = _reference(h64, w.double(), t, wt.double())
    got.backward()
    ref.backward()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)


def test_frozen_head_and_no_grad() -> None:
    h, w, t, wt = _inputs(9, 8, 30, seed=1)
    hg = h.clone().requires_grad_()
    linear_cross_entropy(hg, w, t, wt).backward()  # a frozen head: only the hidden states learn
    ref = h.double().requires_grad_()
    _reference(ref, w.double(), t, wt.double()).backward()
    torch.testing.assert_close(hg.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: the loss alone
        got = linear_cross_entropy(h, w, t, wt)
    torch.testing.assert_close(got.double(), _reference(h.double(), w.double(), t, wt.double()), rtol=1e-6, atol=0)


def test_bf16_inputs_keep_their_dtypes() -> None:
    h, w, t, wt = _inputs(12, 16, 40, seed=2)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    got = linear_cross_entropy(hb, wb, t, wt)
    got.backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    ref = _reference(hb.detach().double(), wb.detach().double(), t, wt.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-3, atol=1e-3)


def _tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def _grads(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [False, True])
def test_causal_lm_loss_equals_transformers(tie: bool) -> None:
    model = _tiny_llama(tie)
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt that is not scored
    ours = causal_lm_loss(model, {"input_ids": ids, "labels": labels})
    ours.backward()
    g_ours = _grads(model)
    model.zero_grad()
    ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    g_ref = _grads(model)
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_weighted_loss_equals_unfused_path() -> None:
    model = _tiny_llama()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (2, 24), generator=g)
    weights = (torch.rand(2, 24, generator=g) < 0.5).float() * 2
    logits = model(input_ids=ids).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, 97), ids[:, 1:].reshape(-1), reduction="none")
    w = weights[:, 1:].reshape(-1)
    ref = (nll * w).sum() / w.sum()
    torch.testing.assert_close(weighted_lm_loss(model, {"input_ids": ids, "loss_weights": weights}), ref)


def test_wrapped_or_transformed_heads_take_the_model_forward() -> None:
    model = _tiny_llama()
    assert lm_loss.plain_head(model) is not None
    wrapper = torch.nn.Module()
    wrapper.module = model  # a data-parallel wrapper: its forward must run to sync gradients
    assert lm_loss.plain_head(wrapper) is None
    model.config.final_logit_softcapping = 30.0
    assert lm_loss.plain_head(model) is None


@pytest.mark.parametrize("tie", [False, True])
def test_peft_trainable_token_rows_are_fused_and_equal_the_model_forward(tie: bool) -> None:
    """The adapt stage's head: LoRA on the linears and peft's trainable rows for new ids. The fused
    loss must see the rows the adapter trained (not the base's) and give their gradients."""
    from peft import LoraConfig, get_peft_model

    model = _tiny_llama(tie)
    heads = ["embed_tokens"] if tie else ["embed_tokens", "lm_head"]
    new_ids = [90, 91, 95, 96]
    cfg = LoraConfig(r=4, target_modules="all-linear", trainable_token_indices={h: new_ids for h in heads})
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # trained rows that differ from the base's
        for name, p in peft_model.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(torch.randn_like(p))
    parts = lm_loss.plain_head(peft_model)
    assert parts is not None and isinstance(parts[1], lm_loss.TrainableTokensHead)
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(5))
    ids[:, ::3] = torch.tensor(new_ids).repeat(7)[: ids[:, ::3].numel()].reshape(3, -1)  # the new ids are targets
    ours = causal_lm_loss(peft_model, {"input_ids": ids})
    ours.backward()
    g_ours = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
    peft_model.zero_grad()
    ref = peft_model(input_ids=ids, labels=ids).loss
    ref.backward()
    g_ref = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert g_ours.keys() == g_ref.keys() and any("trainable_tokens_delta" in n for n in g_ref)
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    with peft_model.disable_adapter():  # adapters off: the base head, as the forward uses
        base = lm_loss.plain_head(peft_model)[1].layer.base_layer.weight
        assert torch.equal(lm_loss.plain_head(peft_model)[1].weight, base)
    assert not torch.equal(lm_loss.plain_head(peft_model)[1].weight, base)  # on again: the trained rows


def _soft_targets(n: int, vocab: int, k: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    probs = torch.rand(n, k, generator=g) ** 3
    return ids, probs / probs.sum(1, keepdim=True)


@pytest.mark.parametrize("chunk_elements", [1 << 26, 7 * 50])
def test_soft_labels_match_float64_cross_entropy(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """Soft labels: sum_k p_k * CE(logits, t_k), and its gradients, against float64 log-softmax."""
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", chunk_elements)
    h, w, _, wt = _inputs(19, 16, 50, seed=7)
    ids, probs = _soft_targets(19, 50, 6)
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    got = linear_cross_entropy(h32, w32, ids, wt, probs)
    row = -(torch.log_softmax(h64 @ w64.t(), -1).gather(1, ids) * probs.double()).sum(1)
    ref = (row * wt.double()).sum() / wt.double().sum()
    got.backward()
    ref.backward()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)


def test_soft_lm_loss_fused_equals_the_models_own_forward() -> None:
    """The fused path of soft_lm_loss against the model's logits in float64, loss and gradients;
    with a one-hot teacher on the next tokens it is the plain causal-LM loss."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (3, 12))
    t_ids, t_probs = _soft_targets(3 * 11, 96, 4)
    batch = {"input_ids": ids, "teacher_ids": t_ids.view(3, 11, 4), "teacher_probs": t_probs.view(3, 11, 4)}
    got = lm_loss.soft_lm_loss(model, batch)
    got.backward()
    fused = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    model64 = LlamaForCausalLM(cfg).double()
    model64.load_state_dict(model.state_dict())
    logp = torch.log_softmax(model64(input_ids=ids).logits[:, :-1], -1)
    ref = -(logp.gather(-1, batch["teacher_ids"]) * batch["teacher_probs"].double()).sum(-1).mean()
    ref.backward()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    for name, q in model64.named_parameters():
        torch.testing.assert_close(fused[name].double(), q.grad, rtol=1e-4, atol=1e-6)
    one_hot = {"input_ids": ids, "teacher_ids": ids[:, 1:, None], "teacher_probs": torch.ones(3, 11, 1)}
    torch.testing.assert_close(lm_loss.soft_lm_loss(model, one_hot), causal_lm_loss(model, {"input_ids": ids}))
