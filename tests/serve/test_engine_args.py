"""`EngineArgs` is the one definition of the engine's options: the server's flags are its fields.

Every field must have exactly one flag with the field's default, type and choices, parsing no
flags must give `EngineArgs()`, and each flag must reach its field. `serve.validate`'s engine
block is checked in tests/warsha/test_serve_validate.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from serve.api.cli import build_parser
from serve.args import EngineArgs, cli_flag

FIELDS = dataclasses.fields(EngineArgs)


def _actions() -> dict[str, object]:
    return {a.dest: a for a in build_parser()._actions}


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_field_has_a_flag_with_its_default(f: dataclasses.Field) -> None:
    action = _actions().get(f.name)
    assert action is not None, f"EngineArgs.{f.name} has no server flag"
    assert cli_flag(f) in action.option_strings
    if f.metadata.get("flag"):  # a negated switch: absent means the field's default (True)
        assert f.default is True and action.default is not False and action.const is False
    else:
        assert action.default == f.default, f"--{f.name}: flag default {action.default!r} != field's {f.default!r}"
        assert action.choices == f.metadata.get("choices")
    assert action.help


def test_no_flags_give_the_default_engine_args_and_flags_reach_their_fields() -> None:
    parser = build_parser()
    assert EngineArgs.from_namespace(parser.parse_args(["m"])) == EngineArgs()
    argv = ["m", "--no-prefix-caching", "--no-adaptive-speculation", "--draft-vocab-size", "0"]
    argv += ["--attention-backend", "torch", "--kv-cache-memory-gb", "0.25", "--max-model-len", "99"]
    args = EngineArgs.from_namespace(parser.parse_args(argv))
    assert args == dataclasses.replace(
        EngineArgs(),
        enable_prefix_caching=False,
        adaptive_speculation=False,
        draft_vocab_size=0,
        attention_backend="torch",
        kv_cache_memory_gb=0.25,
        max_model_len=99,
    )


def test_a_bad_choice_is_refused_by_the_flag_and_by_the_dataclass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["m", "--attention-backend", "flash"])
    assert "--attention-backend" in capsys.readouterr().err
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        EngineArgs(attention_backend="flash")
