"""The one definition of a model directory's tokenizer and chat files, and how they are carried."""

from __future__ import annotations

import json
import os
from pathlib import Path

from warsha import tokenizer_files as tf

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def _write(root: Path, files: dict[str, object]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (root / name).write_text(body if isinstance(body, str) else json.dumps(body))
    return root


def test_copy_tokenizer_takes_the_tokenizer_and_chat_files_only(tmp_path: Path) -> None:
    src = _write(
        tmp_path / "src",
        {
            "tokenizer.json": "{}",
            "tokenizer_config.json": {"eos_token": "</s>"},
            "chat_template.jinja": TEMPLATE,
            "generation_config.json": {"eos_token_id": [2, 7]},
            "config.json": "{}",
            "tokenizer_ext.json": "{}",
            "model.safetensors": "x",
        },
    )
    names = tf.copy_tokenizer(src, tmp_path / "dst")
    assert names == ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == names
    assert tf.chat_setup(tmp_path / "dst") == tf.chat_setup(src)
    assert tf.chat_setup(src)["stop_ids"] == [2, 7] and tf.chat_setup(src)["chat_template"] is True
    assert tf.is_tokenizer_file("tokenizer.model") and tf.is_tokenizer_file("cl100k.tiktoken")
    assert not tf.is_tokenizer_file("chat_template.jinja") and not tf.is_tokenizer_file("tokenizer_ext.json")


def test_inline_template_survives_a_rebuilt_tokenizer_config(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"tokenizer_config.json": {"chat_template": TEMPLATE}})
    dst = _write(tmp_path / "dst", {"tokenizer_config.json": {"eos_token": "</s>"}})  # what extend rewrote
    assert tf.chat_template(dst) is None
    assert tf.carry_chat(src, dst) == ["chat_template.jinja"]
    assert tf.chat_template(dst) == TEMPLATE
    named = _write(
        tmp_path / "named", {"tokenizer_config.json": {"chat_template": [{"name": "default", "template": "x"}]}}
    )
    assert tf.chat_template(named) == "x"


def test_stage_generation_settings_stay_and_stop_ids_are_carried(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"generation_config.json": {"eos_token_id": [2, 7], "max_length": 64}})
    dst = _write(tmp_path / "dst", {"generation_config.json": {"eos_token_id": 2, "max_length": 256}})
    tf.carry_chat(src, dst, generation_config=False)
    assert json.loads((dst / "generation_config.json").read_text()) == {"eos_token_id": [2, 7], "max_length": 256}
    assert tf.stop_ids(dst) == [2, 7]
    assert tf.stop_ids(_write(tmp_path / "cfg", {"config.json": {"eos_token_id": 5}})) == [5]


def test_copies_never_write_through_a_hard_link(tmp_path: Path) -> None:
    """Stages hard-link unchanged files; overwriting one must not edit the upstream artifact."""
    up = _write(tmp_path / "up", {"generation_config.json": {"eos_token_id": 1}})
    down = tmp_path / "down"
    down.mkdir()
    os.link(up / "generation_config.json", down / "generation_config.json")
    src = _write(tmp_path / "src", {"generation_config.json": {"eos_token_id": [1, 9]}})
    tf.carry_chat(src, down)
    assert tf.stop_ids(up) == [1] and tf.stop_ids(down) == [1, 9]
