"""Chat templates: the model's own Jinja template, rendered without transformers.

A template lives in `chat_template.jinja` (transformers 5 writes it there) or in
`tokenizer_config.json` under `chat_template` (a string, or a list of named templates of which
"default" is used). It is rendered in a sandbox with the globals templates in the wild use
(`raise_exception`, `strftime_now`, the special tokens) and, like transformers, the rendered
text is tokenised WITHOUT adding special tokens: the template already wrote the BOS it wants.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

NO_TEMPLATE = (
    "this model has no chat template (no chat_template.jinja and no 'chat_template' in tokenizer_config.json), "
    "so /v1/chat/completions cannot build a prompt; use /v1/completions with a prompt you format yourself, "
    "or add a chat template to the model directory (tokenizer.chat_template = ...; tokenizer.save_pretrained(dir))"
)


class ChatTemplateError(ValueError):
    """The request's messages cannot be rendered (no template, or the template refused them)."""


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def find_template(model_dir: str | Path) -> str | None:
    """The model's default chat template source, or None."""
    root = Path(model_dir)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg_path = root / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    template = json.loads(cfg_path.read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


class ChatTemplate:
    """Render messages to token ids with the model's template."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        root = Path(model_dir)
        self.source = find_template(root)
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        tok_path = root / "tokenizer.json"
        self._tok = HFTokenizer.from_file(str(tok_path)) if tok_path.is_file() else None
        self._compiled = self._compile(self.source) if self.source else None

    @staticmethod
    def _compile(source: str) -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(source)

    @property
    def available(self) -> bool:
        """True when the model ships a chat template."""
        return self._compiled is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; ChatTemplateError if there is no template or it refuses."""
        from jinja2.exceptions import TemplateError

        if self._compiled is None:
            raise ChatTemplateError(NO_TEMPLATE)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt (no special tokens added on top of the template's)."""
        if self._tok is None:
            raise ChatTemplateError("the model directory has no tokenizer.json; chat needs a tokenizer")
        text = self.render(messages, add_generation_prompt)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL; `encode` does not
