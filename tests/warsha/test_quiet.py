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


class _Records(logging.Handler):
    """Collects what reaches a logger's own handlers (after the logger's filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_too_long_notice_is_dropped_and_nothing_else() -> None:
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.removeFilter(cli._drop_too_long_notice)  # another test's CLI run may have installed it
    verbosity, records = hf_logging.get_verbosity(), _Records()
    hf_logging.set_verbosity_warning()
    logger.addHandler(records)
    try:
        _tiny_tokenizer(4)("a b " * 10)
        assert any(m.startswith("Token indices sequence length") for m in records.messages)  # it exists unfiltered
        records.messages.clear()
        cli.quiet_environment()
        _tiny_tokenizer(4)("a b " * 10)
        assert records.messages == []
        other = logging.LogRecord("transformers", logging.WARNING, __file__, 1, "something else", None, None)
        assert cli._drop_too_long_notice(other)
    finally:
        logger.removeHandler(records)
        logger.removeFilter(cli._drop_too_long_notice)
        hf_logging.set_verbosity(verbosity)


def test_deepspeed_is_told_the_device_where_no_gpu_driver_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cli.quiet_environment()
    no_driver = not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/kfd"))
    assert (os.environ.get("DS_ACCELERATOR") == "cpu") == no_driver
