"""A checkpoint of a tied model with peft's trainable-token rows: saved without accelerate's
shared-tensor warning, and every trained row back after loading (through the tie)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.warsha.test_lm_loss import _tiny_llama
from warsha.training import save_state


@pytest.mark.parametrize("tie", [True, False])
def test_trained_rows_survive_a_quiet_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture, tie: bool) -> None:
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    heads = ["embed_tokens"] if tie else ["embed_tokens", "lm_head"]
    cfg = LoraConfig(r=4, target_modules="all-linear", trainable_token_indices={h: [90, 91, 95] for h in heads})
    acc = Accelerator(cpu=True)
    model = acc.prepare(get_peft_model(_tiny_llama(tie), cfg))
    deltas = {n: p for n, p in model.named_parameters() if "trainable_tokens_delta" in n}
    assert len(deltas) == len(heads)
    with torch.no_grad():
        for p in deltas.values():
            p.add_(torch.randn_like(p))
    trained = {n: p.detach().clone() for n, p in deltas.items()}
    head_rows = model.get_output_embeddings().token_adapter.trainable_tokens_delta["default"].detach().clone()
    with caplog.at_level(logging.WARNING):
        save_state(acc, tmp_path / "ckpt")
    assert not [r for r in caplog.records if "shared tensor" in r.getMessage()]
    with torch.no_grad():
        for p in deltas.values():
            p.zero_()
    acc.load_state(str(tmp_path / "ckpt"))
    for n, p in deltas.items():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0, msg=n)
    head = model.get_output_embeddings().token_adapter.trainable_tokens_delta["default"]
    torch.testing.assert_close(head.detach(), head_rows, rtol=0, atol=0)  # the head's rows, tied or not
