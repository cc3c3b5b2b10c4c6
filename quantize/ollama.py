"""An Ollama ``Modelfile`` for a GGUF export: FROM, TEMPLATE, stop tokens, PARAMETER lines.

Why templates are chosen, not translated: Ollama's TEMPLATE is a Go template over
``.Messages``, the model's chat template is Jinja, and no general translation exists. The
chat formats in use are few and recognisable by their markers, so the Jinja template selects
the matching Go template (the ones Ollama's own library ships for those families) and its
stop tokens. A model with no chat template (a base model) gets no TEMPLATE: Ollama then
passes the prompt through as it is, which is what completion from a base model needs. An
unrecognised template is reported, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatFormat:
    """A chat family: the marker that identifies its Jinja template, Ollama's template, stops."""

    name: str
    marker: str
    template: str
    stops: tuple[str, ...]


FORMATS = (
    ChatFormat(
        "gemma",
        "<start_of_turn>",
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
        '{{- if or (eq .Role "user") (eq .Role "system") }}<start_of_turn>user\n'
        "{{ .Content }}<end_of_turn>\n"
        "{{ if $last }}<start_of_turn>model\n"
        "{{ end }}\n"
        '{{- else if eq .Role "assistant" }}<start_of_turn>model\n'
        "{{ .Content }}{{ if not $last }}<end_of_turn>\n"
        "{{ end }}\n"
        "{{- end }}\n"
        "{{- end }}",
        ("<end_of_turn>",),
    ),
    ChatFormat(
        "chatml",
        "<|im_start|>",
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        ("<|im_end|>",),
    ),
    ChatFormat(
        "llama3",
        "<|start_header_id|>",
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
        "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("<|eot_id|>",),
    ),
)


def chat_template(model_dir: Path) -> str | None:
    """The model's Jinja chat template (``chat_template.jinja`` or ``tokenizer_config.json``)."""
    jinja = Path(model_dir) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = Path(model_dir) / "tokenizer_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
    return None


def chat_format(template: str | None) -> ChatFormat | None:
    """The family whose marker the template contains; None for no template."""
    if not template:
        return None
    for fmt in FORMATS:
        if fmt.marker in template:
            return fmt
    raise ValueError(
        "quantize.gguf: the model's chat template matches none of the Modelfile formats"
        f" ({', '.join(f.name for f in FORMATS)}); add its family to quantize/ollama.py FORMATS"
    )


def _quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def modelfile(gguf_name: str, fmt: ChatFormat | None, eos_tokens: list[str], parameters: dict[str, Any]) -> str:
    """The Modelfile text: the GGUF beside it, the template, one ``PARAMETER stop`` per stop."""
    lines = [f"FROM ./{gguf_name}"]
    if fmt is not None:
        if '"""' in fmt.template:
            raise ValueError(f"quantize.gguf: the {fmt.name} template contains a triple quote")
        lines.append(f'TEMPLATE """{fmt.template}"""')
    stops = list(dict.fromkeys((fmt.stops if fmt else ()) + tuple(t for t in eos_tokens if t)))
    lines += [f"PARAMETER stop {_quote(s)}" for s in stops]
    for key, value in parameters.items():
        if key == "stop":
            raise ValueError("quantize.gguf: ollama_parameters.stop: stop tokens come from the model; remove it")
        lines.append(f"PARAMETER {key} {_quote(value) if isinstance(value, str) else value}")
    return "\n".join(lines) + "\n"
