"""The CLI's quiet environment: third-party notices that fire on every command are gone, nothing else."""

from __future__ import annotations

import logging
import os

import pytest

from warsha import cli


def _tiny_tokenizer(max_length: int):  # noqa: ANN202 - transformers' type
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, model_max_length=max_length)


def test_too_long_notice_is_dropped_and_nothing_else(capfd: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("transformers.tokenization_utils_base")
    _tiny_tokenizer(4)("a b " * 10)
    assert "Token indices sequence length" in capfd.readouterr().err  # the notice exists without the filter
    cli._quiet_environment()
    try:
        _tiny_tokenizer(4)("a b " * 10)
        assert "Token indices sequence length" not in capfd.readouterr().err
        other = logging.LogRecord("transformers", logging.WARNING, __file__, 1, "something else", None, None)
        assert cli._drop_too_long_notice(other)
    finally:
        logger.removeFilter(cli._drop_too_long_notice)


def test_deepspeed_is_told_the_device_where_no_gpu_driver_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cli._quiet_environment()
    no_driver = not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/kfd"))
    assert (os.environ.get("DS_ACCELERATOR") == "cpu") == no_driver
