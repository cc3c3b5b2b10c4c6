"""End-to-end engine tests on tiny random checkpoints, against transformers' generate."""

import json
from pathlib import Path

import pytest
import torch

from serve import LLM, AdmissionError, SamplingParams, cpu_kernels
from serve.args import EngineArgs
from serve.head_quant import Int8Linear
from serve.quant import DenseLinear
from tests.serve.conftest import hf_model, make_model, write_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def random_prompts(n: int, seed: int, vocab: int = 300, lo: int = 2, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(tiny_dir: Path):
    return hf_model(tiny_dir)


@pytest.fixture(scope="module")
def reference_outputs(hf_reference) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    prompts = random_prompts(20, seed=0)
    return prompts, [hf_greedy(hf_reference, p, 16) for p in prompts]


def finish(llm: LLM) -> None:
    assert not llm.has_unfinished_requests()
    llm.block_manager.check_no_leaks()


def test_greedy_matches_hf_generate(tiny_dir: Path, reference_outputs) -> None:  # noqa: ANN001
    prompts, expected = reference_outputs
    llm = LLM(tiny_dir, dtype="float32")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    finish(llm)


def test_chunked_prefill_and_preemption_keep_outputs(tiny_dir: Path, reference_outputs) -> None:  # noqa: ANN001
    prompts, expected = reference_outputs
    llm = LLM(tiny_dir, dtype="float32", max_num_batched_tokens=24, num_kv_blocks=12, block_size=8)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.stats.num_preemptions > 0
    finish(llm)


def test_prefix_cache_hits_keep_outputs(tiny_dir: Path, reference_outputs) -> None:  # noqa: ANN001
    prompts, expected = reference_outputs
    shared = prompts[0] * 3
    llm = LLM(tiny_dir, dtype="float32", block_size=4)
    first = llm.generate([shared], GREEDY)[0].token_ids
    again = llm.generate([shared, shared], GREEDY)
    assert [o.token_ids for o in again] == [first, first]
    assert llm.stats.prefix_cache_hit_rate > 0.3
    assert llm.generate(prompts[:5], GREEDY)[1].token_ids == expected[1]
    finish(llm)


def test_speculative_greedy_identical_and_accepts(spec_pair: tuple[Path, Path]) -> None:
    target, draft = spec_pair
    prompts = random_prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, draft, dtype="float32", num_speculative_tokens=3, adaptive_speculation=False, block_size=4)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.stats.acceptance_rate > 0.5
    assert llm.stats.mean_accepted_length > 1.5
    finish(llm)


def test_bfloat16_draft_under_a_float32_target_keeps_outputs(spec_pair: tuple[Path, Path]) -> None:
    """The draft only proposes: its dtype moves acceptance, never the target's greedy output."""
    target, draft = spec_pair
    prompts = random_prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, draft, dtype="float32", draft_dtype="bfloat16", adaptive_speculation=False, block_size=4)
    assert llm.runner.draft.dtype == torch.bfloat16 and llm.runner.target.dtype == torch.float32
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.stats.acceptance_rate > 0.5
    finish(llm)
    with pytest.raises(ValueError, match="draft_dtype='float16'"):
        LLM(target, draft, draft_dtype="float16")


@pytest.mark.skipif(not cpu_kernels.available(), reason="the int8 head needs serve's AVX2 kernels")
def test_draft_head_is_int8_by_default_on_cpu_and_keeps_outputs(
    spec_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto: the draft's head in int8 (acceptance may move, the target's greedy output may not);
    none, or no kernels, keeps the checkpoint's head; the target's head is never touched."""
    target, draft = spec_pair
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, dtype="float32").generate(prompts, params)]
    for choice, head_type in (("auto", Int8Linear), ("none", DenseLinear)):
        llm = LLM(target, draft, dtype="float32", draft_head_quant=choice, adaptive_speculation=False, block_size=4)
        assert isinstance(llm.runner.draft.head, head_type) and isinstance(llm.runner.target.head, DenseLinear)
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.stats.acceptance_rate > 0.5
        finish(llm)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert isinstance(LLM(target, draft, dtype="float32").runner.draft.head, DenseLinear)
    with pytest.raises(ValueError, match="draft_head_quant='int4'"):
        EngineArgs(draft_head_quant="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineArgs(draft_head_quant="int8", device="cuda")


def test_speculation_with_rejections_sampling_and_tiny_pool(tiny_dir: Path, draft_dir: Path, reference_outputs) -> None:  # noqa: ANN001
    prompts, expected = reference_outputs
    llm = LLM(
        tiny_dir,
        draft_dir,
        dtype="float32",
        num_speculative_tokens=2,
        adaptive_speculation=False,
        num_kv_blocks=14,
        block_size=8,
    )
    outs = llm.generate(prompts[:8], GREEDY)
    assert [o.token_ids for o in outs] == expected[:8]
    sampled = llm.generate(
        prompts[:4], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    )
    assert all(len(o.token_ids) == 12 for o in sampled)
    assert llm.stats.spec_proposed > 0
    finish(llm)


def test_adaptive_switch_turns_off_a_useless_draft(tiny_dir: Path, draft_dir: Path) -> None:
    llm = LLM(tiny_dir, draft_dir, dtype="float32", num_speculative_tokens=4)
    llm.spec.probe_every = 1000
    llm.generate(random_prompts(2, seed=3), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert llm.stats.spec_steps < llm.stats.plain_decode_steps  # random draft: acceptance ~0, so it stops
    finish(llm)


def test_text_prompts_stops_seeds_logprobs(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32")
    base = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert base.prompt_token_ids[0] == 1 and len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_id = base.token_ids[3]
    cut = llm.generate(
        "the quick brown fox", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    )[0]
    assert cut.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1] and cut.finish_reason == "stop"
    assert base.text.strip()
    stop_text = next(ch for ch in base.text[len(base.text) // 2 :] + base.text if not ch.isspace())
    s = llm.generate(
        "the quick brown fox", SamplingParams(temperature=0, max_tokens=12, stop=stop_text, ignore_eos=True)
    )[0]
    assert s.finish_reason == "stop" and stop_text not in s.text and base.text.startswith(s.text)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=11, ignore_eos=True)
    a, b = llm.generate(["hello", "hello"], [seeded, seeded])
    assert a.token_ids == b.token_ids
    lp = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert len(lp.logprobs) == 3 and all(len(d) >= 2 for d in lp.logprobs)
    pen = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.5, ignore_eos=True)
    )[0]
    assert len(pen.token_ids) == 8
    finish(llm)


def test_step_api_and_abort(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32")
    rid = llm.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    other = llm.add_request([7, 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seen: dict[str, list[int]] = {}
    for _ in range(3):
        for out in llm.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(seen[rid]) == 3 and len(seen[other]) == 2
    assert llm.abort(rid) and not llm.abort(rid)
    finish(llm)


def test_bad_inputs_named(tiny_dir: Path, tmp_path: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=64)
    with pytest.raises(AdmissionError, match="max_model_len"):
        llm.add_request(list(range(3, 70)), SamplingParams(max_tokens=4))
    with pytest.raises(AdmissionError, match="empty"):
        llm.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([10**6])
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([[3, 4]], SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_dir, max_model_len=10**6)
    finish(llm)


def test_draft_vocab_mismatch_refused(tiny_dir: Path, tmp_path: Path) -> None:
    other = make_model(tmp_path / "other", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(other / "tokenizer.json"))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    data["model"]["merges"] = []
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="first differing id 100"):
        LLM(tiny_dir, other)
    bigger = make_model(
        tmp_path / "bigger",
        vocab_size=write_tokenizer(tmp_path / "t") + 8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
    )
    with pytest.raises(ValueError, match="first differing id"):
        LLM(tiny_dir, bigger)


def test_unsupported_architecture_refused(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        LLM(path)


def _restricted_copy(draft: Path, tmp_path: Path, ids: list[int]) -> Path:
    import shutil

    out = tmp_path / "restricted_draft"
    shutil.copytree(draft, out)
    (out / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    return out


def test_restricted_draft_head_is_exact_and_uses_only_its_ids(spec_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A draft computing logits for a subset of ids still gives exactly the target's output."""
    from serve.model import DecoderModel

    target, draft = spec_pair
    vocab = DecoderModel.load(draft, "float32").lm_head.shape[0]
    ids = list(range(0, vocab, 3))  # a third of the vocabulary: the target picks many ids outside it
    restricted = _restricted_copy(draft, tmp_path, ids)
    prompts = random_prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, restricted, dtype="float32", num_speculative_tokens=3, adaptive_speculation=False, block_size=4)
    assert llm.runner.draft.lm_head.shape[0] == len(ids)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.stats.spec_proposed > 0
    full = LLM(target, draft, dtype="float32", num_speculative_tokens=3, adaptive_speculation=False)
    assert full.stats.acceptance_rate is None and full.runner.draft.head_ids is None
    proposed: list[int] = []
    propose = llm.runner._propose_rest

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = propose(*args, **kwargs)
        proposed.extend(out.tokens[r, : int(out.counts[r])].tolist() for r in range(len(out.rows)))
        return out

    llm.runner._propose_rest = spy  # type: ignore[method-assign]
    sampled = llm.generate(
        prompts[:3], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    )
    assert all(len(o.token_ids) == 10 for o in sampled)
    assert proposed and set(sum(proposed, [])) <= set(ids)  # sampled drafts never leave the subset
    capped = LLM(target, restricted, dtype="float32", draft_vocab_size=10)
    assert capped.runner.draft.head_ids.tolist() == ids[:10]
    assert LLM(target, restricted, dtype="float32", draft_vocab_size=0).runner.draft.head_ids is None
    finish(llm)


def test_restricted_draft_vocab_file_errors(spec_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = spec_pair
    bad = _restricted_copy(draft, tmp_path, [1, 1, 2])
    with pytest.raises(ValueError, match="distinct"):
        LLM(target, bad, dtype="float32")
    (bad / "draft_vocab.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="token_ids"):
        LLM(target, bad, dtype="float32")


def test_engine_on_triton_kernels_matches_torch_backend(tiny_dir: Path, draft_dir: Path) -> None:
    """The whole engine (prefill, chunked prefill, decode, cache writes, speculation) on the
    Triton backend, run by Triton's interpreter on CPU, against the torch backend."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET before triton loads"
    prompts = random_prompts(3, seed=11, hi=40)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    common = dict(dtype="float32", block_size=16, max_num_batched_tokens=32)
    ref = LLM(tiny_dir, draft_dir, num_speculative_tokens=2, adaptive_speculation=False, **common).generate(
        prompts, params
    )
    llm = LLM(
        tiny_dir, draft_dir, num_speculative_tokens=2, adaptive_speculation=False, attention_backend="triton", **common
    )
    assert type(llm.runner.target.backend).__name__ == "TritonPagedAttention"
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ref]
    finish(llm)
