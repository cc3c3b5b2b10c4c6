"""The real Gemma 3 270M (dequantized from the PyPI GGUF) served by the engine vs transformers.

Skipped, with the reason, only when the `real` extra is not installed. The fast test is a short
greedy comparison; the slow ones run 16 Arabic and English prompts (some longer than the
512-token window) for 64 tokens, and every position of a 2,000-token sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.serve.real_gemma import cached_dir, missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

SHORT_PROMPTS = ["عاصمة مصر هي", "The capital of France is"]
LONG_TEXT_AR = "ذهب الولد إلى المدرسة في الصباح الباكر وقرأ كتابا عن تاريخ المدن القديمة. "
LONG_TEXT_EN = "The old library kept its maps in wooden drawers, and every visitor signed the ledger. "
SLOW_PROMPTS = [
    "عاصمة مصر هي",
    "The capital of France is",
    "كان يا ما كان في قديم الزمان",
    "Once upon a time, in a small village,",
    "أفضل طريقة لتعلم البرمجة هي",
    "The three primary colors are",
    "من أشهر الشعراء العرب",
    "Water boils at a temperature of",
    "اكتب قصة قصيرة عن قطة",
    "def fibonacci(n):",
    "السلام عليكم، كيف حالك اليوم؟",
    "A good breakfast includes",
    LONG_TEXT_AR * 40 + "\nلخص ما سبق:",
    LONG_TEXT_EN * 40 + "\nSummary:",
    LONG_TEXT_AR * 25 + LONG_TEXT_EN * 20,
    "الرياضيات هي",
]


@pytest.fixture(scope="module")
def gemma() -> tuple[Path, object, object]:
    """The HF directory, the transformers float32 reference and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cached_dir()
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    return path, ref, AutoTokenizer.from_pretrained(str(path))


def _hf_greedy(ref: object, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


def _greedy_compare(gemma: tuple[Path, object, object], prompts: list[str], n: int) -> None:
    from serve import LLM, SamplingParams

    path, ref, tok = gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=1024, max_num_batched_tokens=256)
    ids = [tok(p)["input_ids"] for p in prompts]
    assert all(i[0] == tok.bos_token_id for i in ids)
    outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for p, i, out in zip(prompts, ids, outs):
        assert out.token_ids == _hf_greedy(ref, i, n), f"prompt {p[:40]!r} ({len(i)} tokens)"
    llm.block_manager.check_no_leaks()


def test_short_greedy_matches_transformers(gemma: tuple[Path, object, object]) -> None:
    _greedy_compare(gemma, SHORT_PROMPTS, 16)


@pytest.mark.slow
def test_sixteen_prompts_sixtyfour_tokens_match_transformers(gemma: tuple[Path, object, object]) -> None:
    path, _, tok = gemma
    assert sum(len(tok(p)["input_ids"]) > 512 for p in SLOW_PROMPTS) >= 3  # past the sliding window
    _greedy_compare(gemma, SLOW_PROMPTS, 64)


@pytest.mark.slow
def test_logits_within_1e4_at_every_position_of_2000_tokens(gemma: tuple[Path, object, object]) -> None:
    from serve.model import DecoderModel

    path, ref, tok = gemma
    ids = tok(LONG_TEXT_AR * 60 + LONG_TEXT_EN * 40)["input_ids"][:2000]
    assert len(ids) == 2000
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = DecoderModel.load(path, "float32").prefill_logits(ids, block_size=16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
