"""Chat evaluation for an instruct base: does the adapted model still answer like a chat model?

Bits per character says nothing about what an instruct model's users see. When the base has a
chat template, ``tokenizer_ext.adapt`` asks each model (the base, the base adapted with the same
budget, the extended model) a few held-out questions in the target and the source language,
formatted with the template, and reads the greedy answer:

- ``turn_ended``: the answer ends with one of the stop ids (``generation_config.json``'s
  ``eos_token_id``, the template's end-of-turn token) within ``max_new_tokens``;
- ``script_share``: the share of the answer's letters in the script of the language asked
  (Arabic letters in answers to Arabic questions; ``script_leak.letter_script`` names scripts);
- ``special_tokens``: the special tokens the answers emitted (the stop token included). A model
  that learned to write ``<|im_start|>`` mid-answer, or ends its turns with another token than
  the base, shows here.

The questions are written here, not drawn from the training corpus (hadith), so no stage saw
them; their answers are greedy, so the figures are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizer_ext.script_leak import letter_script

QUESTIONS = {
    "ar": (
        "ما هي عاصمة مصر؟",
        "اكتب جملة قصيرة عن فائدة القراءة.",
        "اذكر ثلاثة أنواع من الفاكهة.",
        "لماذا نحتاج إلى النوم؟",
    ),
    "en": (
        "What is the capital of France?",
        "Write one short sentence about why reading is useful.",
        "Name three kinds of fruit.",
        "Why do we need sleep?",
    ),
}
# The script whose letters answer a question in each language.
SCRIPT = {"ar": "ARABIC", "en": "LATIN"}


def script_share(text: str, script: str) -> float | None:
    """Share of ``text``'s letters written in ``script``; None for a text without letters."""
    scripts = [s for s in map(letter_script, text) if s]
    return sum(s == script for s in scripts) / len(scripts) if scripts else None


def answer_record(
    new_ids: Sequence[int], stop_ids: set[int], special: dict[int, str], decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """One greedy answer: whether and where the turn ended, the specials it emitted, its text.

    The answer is cut at the first stop id (the engine stops there too); ``decode`` turns the
    ids before it into text without special tokens.
    """
    ids = list(new_ids)
    end = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    body = ids if end is None else ids[:end]
    emitted = ids if end is None else ids[: end + 1]
    return {
        "turn_ended": end is not None,
        "tokens": len(body) if end is None else end + 1,
        "special_tokens": sorted({special[t] for t in emitted if t in special}),
        "text": decode([t for t in body if t not in special]),
    }


def summarise(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per language: share of turns ended, mean answer tokens, mean script share; and the union
    of special tokens emitted over all answers."""
    out: dict[str, Any] = {}
    specials: set[str] = set()
    for lang, recs in records.items():
        shares = [s for r in recs if (s := script_share(r["text"], SCRIPT[lang])) is not None]
        out[lang] = {
            "turn_ended": sum(r["turn_ended"] for r in recs) / len(recs),
            "mean_tokens": sum(r["tokens"] for r in recs) / len(recs),
            "script_share": sum(shares) / len(shares) if shares else None,
        }
        specials.update(t for r in recs for t in r["special_tokens"])
    out["special_tokens"] = sorted(specials)
    return out


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other`` against ``base``: turns end as often, answers keep their script (within 0.1),
    and the same special tokens are emitted. Getting better is never a miss."""
    out: dict[str, Any] = {"same_special_tokens": base["special_tokens"] == other["special_tokens"]}
    for lang in (k for k in QUESTIONS if k in base and k in other):
        b, o = base[lang], other[lang]
        out[f"{lang}_turn_ended_not_worse"] = o["turn_ended"] >= b["turn_ended"]
        if b["script_share"] is not None:
            out[f"{lang}_script_share_within_0.1"] = (o["script_share"] or 0.0) >= b["script_share"] - 0.1
    return out


def stop_ids(tok: Any, model: Any) -> set[int]:
    """Where a turn ends: the generation config's ``eos_token_id`` (an id or a list) and the
    tokenizer's eos."""
    value = getattr(model.generation_config, "eos_token_id", None)
    ids = set(value if isinstance(value, list) else [value] if value is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def evaluate(model: Any, tok: Any, langs: Sequence[str], max_new_tokens: int) -> dict[str, Any]:
    """Ask ``model`` the :data:`QUESTIONS` of ``langs`` through ``tok``'s chat template; the
    summary and every answer (so the report can show what the model said)."""
    import torch

    model.eval()
    stops = stop_ids(tok, model)
    special = {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}
    special.update({i: tok.convert_ids_to_tokens(i) for i in tok.all_special_ids})
    records: dict[str, list[dict[str, Any]]] = {}
    for lang in (x for x in langs if x in QUESTIONS):
        records[lang] = []
        for question in QUESTIONS[lang]:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = torch.tensor([list(prompt)])
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    max_length=None,
                    do_sample=False,
                    eos_token_id=sorted(stops) or None,
                    pad_token_id=min(stops) if stops else tok.pad_token_id,
                )
            rec = answer_record(out[0, ids.shape[1] :].tolist(), stops, special, tok.decode)
            records[lang].append({"question": question, **rec})
    return {**summarise(records), "answers": records}
