"""``benchmarks.init_probe``'s chain rows: the completion log-probabilities against one forward
per piece in float64, and the constant direction against its definition."""

from __future__ import annotations

import torch

from benchmarks.init_probe import candidate_rows, completion_logprobs, constant_direction, untied
from tests.gemma3_tiny import gemma3_config


def tiny_model(vocab: int = 96) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    return Gemma3ForCausalLM(gemma3_config(vocab)).eval()


def test_completion_logprobs_match_one_forward_per_piece() -> None:
    model = tiny_model()
    sources = [[7], [8, 9], [10, 11, 12], [13, 14], [20, 21, 22, 23], [5]]
    got = completion_logprobs(model, sources, bos=2, batch=2)  # batches mix lengths and pad
    ref = model.double()
    for i, s in enumerate(sources):
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=torch.tensor([[2, *s]])).logits[0].double(), -1)
        want = sum(float(logp[k, s[k]]) for k in range(1, len(s)))  # logits[k] follow s_0..s_{k-1}
        assert abs(float(got[i]) - want) < 1e-4, (i, float(got[i]), want)
    assert float(got[0]) == 0.0 and float(got[5]) == 0.0


class _Tok:
    """Whitespace ids for ``constant_direction``: each character's code point modulo the vocab."""

    def __call__(self, text: str, **_: object) -> object:
        ids = torch.tensor([[2, *(ord(c) % 90 + 5 for c in text)]])
        return type("Enc", (), {"input_ids": ids})()


def test_constant_direction_is_the_least_squares_solution() -> None:
    model = tiny_model()
    texts = ["some text here", "another longer line of text to read"]
    u = constant_direction(model, _Tok(), texts, 64)
    with torch.no_grad():
        h = torch.cat([model.model(input_ids=_Tok()(t).input_ids).last_hidden_state[0, 1:] for t in texts]).double()
    residual = h @ u.double() - 1.0
    assert torch.allclose(h.T @ residual, torch.zeros(h.shape[1], dtype=torch.float64), atol=1e-3)  # normal equations


def test_chain_rows_add_the_completion_along_u() -> None:
    base = torch.randn(30, 8)
    sources = [[3, 4], [5]]
    extra = {"completion": torch.tensor([-2.0, 0.0]), "u": torch.ones(8)}
    rows = candidate_rows("chain", base, sources, extra)
    assert torch.equal(rows[0], base[3] - 2.0) and torch.equal(rows[1], base[5])


def test_untied_head_is_a_separate_copy() -> None:
    model = untied(tiny_model())
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != emb.data_ptr() and torch.equal(head, emb)
