"""The files a model directory's tokenizer and chat setup consist of, and carrying them on.

One definition for every stage. A stage that writes new weights beside an old tokenizer
(``tokenizer_ext.embed`` and ``adapt``, ``distill.draft``, the quantizers) copies
:data:`TOKENIZER_FILES` and :data:`CHAT_FILES`; a stage that writes a new tokenizer
(``tokenizer_ext.extend``, ``context_ext.yarn``) carries :data:`CHAT_FILES` over what it wrote.
An instruct model is only an instruct model with its chat template (``serve``'s
``/v1/chat/completions`` refuses without one) and its end-of-turn stop ids
(``generation_config.json``'s ``eos_token_id``: without them generation runs past the turn).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

# The vocabulary and its side files (glob patterns, matched in the model directory itself).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
)
# What makes it a chat model: the template (transformers 5 writes chat_template.jinja; processors
# and older savers chat_template.json) and the stop ids the turn ends with.
CHAT_FILES = ("chat_template.jinja", "chat_template.json", "generation_config.json")


def matching(src: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files directly in ``src`` that match any of ``patterns``, sorted, each once."""
    found = {f for pattern in patterns for f in Path(src).glob(pattern) if f.is_file()}
    return sorted(found)


def is_tokenizer_file(name: str) -> bool:
    """Whether a file name is one of :data:`TOKENIZER_FILES` (what a new tokenizer replaces)."""
    from fnmatch import fnmatch

    return any(fnmatch(name, pattern) for pattern in TOKENIZER_FILES)


def _copy(src: Path, dst: Path) -> None:
    """Copy without writing through a hard link (artifacts share unchanged files by linking)."""
    dst.unlink(missing_ok=True)
    shutil.copy2(src, dst)


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and the chat setup of ``src`` into ``dst`` byte for byte; their names."""
    Path(dst).mkdir(parents=True, exist_ok=True)
    names = [f.name for f in matching(src, TOKENIZER_FILES)]
    for name in names:
        _copy(Path(src) / name, Path(dst) / name)
    return sorted(names + carry_chat(src, dst))


def carry_chat(src: Path, dst: Path, generation_config: bool = True) -> list[str]:
    """Copy the chat setup of ``src`` into ``dst``; the names written.

    A template ``src`` keeps inside ``tokenizer_config.json`` is written as
    ``chat_template.jinja`` when ``dst`` has none (a stage that rebuilt ``tokenizer_config.json``
    dropped it). ``generation_config=False`` leaves a ``dst`` generation config that the stage
    changed on purpose (a new ``max_length``) and copies only its stop ids from ``src``.
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    for f in matching(src, CHAT_FILES):
        if f.name == "generation_config.json" and not generation_config and (dst / f.name).is_file():
            _merge_stop_ids(f, dst / f.name)
        else:
            _copy(f, dst / f.name)
        written.append(f.name)
    inline = _config_template(src)
    if inline is not None and chat_template(dst) is None:
        (dst / "chat_template.jinja").write_text(inline)
        written.append("chat_template.jinja")
    return sorted(set(written))


def _merge_stop_ids(src: Path, dst: Path) -> None:
    """Give ``dst``'s generation config the special-token ids of ``src``'s, keeping the rest."""
    theirs, ours = json.loads(src.read_text()), json.loads(dst.read_text())
    keys = ("eos_token_id", "bos_token_id", "pad_token_id")
    if all(ours.get(k) == theirs.get(k) for k in keys):
        return
    ours.update({k: theirs[k] for k in keys if k in theirs})
    dst.unlink()
    dst.write_text(json.dumps(ours, indent=2, sort_keys=True) + "\n")


def _config_template(root: Path) -> str | None:
    """The default template kept in ``tokenizer_config.json`` (a string, or a named list)."""
    path = Path(root) / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) and template.strip() else None


def chat_template(root: Path) -> str | None:
    """The model directory's default chat template, where serve and transformers look for it
    (``serve/api/chat_template.py`` reads it the same way; serve imports nothing from here)."""
    jinja = Path(root) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    return _config_template(root)


def stop_ids(root: Path) -> list[int]:
    """The ids generation stops on: ``generation_config.json``'s ``eos_token_id`` (an id or a
    list), else ``config.json``'s; sorted."""
    for name in ("generation_config.json", "config.json"):
        path = Path(root) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return sorted({int(v) for v in (value if isinstance(value, list) else [value])})
    return []


def chat_setup(root: Path) -> dict[str, Any]:
    """What a stage's manifest records of the chat setup, so a stage that lost it shows: whether
    a template is present, its sha256 (the same in every artifact of a run) and the stop ids."""
    template = chat_template(root)
    return {
        "chat_template": template is not None,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "stop_ids": stop_ids(root),
    }
