"""Turns a scheduled batch into forwards: draft proposals, the target forward, verification.

Separated from `engine.py` so that the engine keeps request bookkeeping and this module keeps
tensor work. Everything a call needs is passed in; the runner owns only the models, their KV
caches and the default random generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.attention import SeqChunk
from serve.kv_cache import KVCache
from serve.model import DecoderModel, ForwardBatch
from serve.prompt_lookup import lookup
from serve.sampler import SamplingParams, argmax_ids, param_tensors, process_logits, sample
from serve.scheduler import ScheduledBatch
from serve.sequence import Sequence
from serve.spec_decode import RejectionResult, greedy_verify, rejection_sample


@dataclass
class Proposal:
    """Draft tokens for the speculating rows of a batch (row i of the batch -> index here)."""

    rows: list[int]
    tokens: torch.Tensor  # [S, kmax] (padding 0)
    probs: torch.Tensor | None  # [S, kmax, V] (padding 0); None when every speculating row is greedy
    counts: torch.Tensor  # [S] real drafts per row
    looked_up: list[bool] | None = None  # per row: drafted by prompt lookup (None: all by the draft model)


@dataclass
class TargetOutput:
    """Logits of the target forward: `last[i]` row for sampled rows, `spec[j]` rows per speculator."""

    sample_rows: list[int]  # batch rows that caught up without speculation
    sample_logits: torch.Tensor  # [len(sample_rows), V]
    spec_logits: list[torch.Tensor]  # per proposal row: [k_i + 1, V]


def build_forward(
    seqs: list[Sequence], starts: list[int], token_lists: list[list[int]], logits_rows: list[list[int]]
) -> ForwardBatch:
    """Flat batch from per-sequence chunks; `logits_rows[i]` are offsets within chunk i."""
    ids: list[int] = []
    positions: list[int] = []
    chunks: list[SeqChunk] = []
    wanted: list[int] = []
    for seq, start, toks, rows in zip(seqs, starts, token_lists, logits_rows):
        base = len(ids)
        ids.extend(toks)
        positions.extend(range(start, start + len(toks)))
        chunks.append(SeqChunk(base, len(toks), start + len(toks), seq.block_table, tuple(seq.group_tables)))
        wanted.extend(base + r for r in rows)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        chunks=chunks,
        logits_indices=torch.tensor(wanted, dtype=torch.long),
    )


class ModelRunner:
    """Target (and optional draft) model with their paged caches."""

    def __init__(
        self,
        target: DecoderModel,
        target_kv: KVCache,
        draft: DecoderModel | None,
        draft_kv: KVCache | None,
        seed: int,
        lookup_sizes: tuple[int, int] | None = None,
    ) -> None:
        """`lookup_sizes`: (min_n, max_n) of prompt lookup (`serve.prompt_lookup`), None for none."""
        self.target, self.target_kv = target, target_kv
        self.draft, self.draft_kv = draft, draft_kv
        self.lookup_sizes = lookup_sizes
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.num_draft_forwards = 0
        self.num_target_forwards = 0
        self.last_draft_catch_up = 0  # most tokens a speculating row fed the draft this step

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Perform queued copy-on-write copies in every cache."""
        self.target_kv.copy_blocks(pairs)
        if self.draft_kv is not None:
            self.draft_kv.copy_blocks(pairs)

    # ----------------------------------------------------------------- draft
    def propose(self, batch: ScheduledBatch, generators: dict[str, torch.Generator]) -> Proposal | None:
        """Drafts for the speculating rows: a prompt lookup where one is found (`lookup` set),
        the draft model for the rest. The draft also runs over prefill chunks to keep its cache
        in step; rows that looked up skip it and it catches up when it next proposes for them."""
        spec_rows = [i for i, k in enumerate(batch.num_spec_tokens) if k > 0]
        looked = self._look_up(batch, spec_rows)
        model_rows = [i for i in spec_rows if i not in looked] if self.draft is not None else []
        logits = self._draft_catch_up(batch, model_rows)
        drafted = (
            self._propose_rest(batch, model_rows, logits, generators) if logits is not None and model_rows else None
        )
        return self._merge(batch, looked, drafted)

    def _look_up(self, batch: ScheduledBatch, rows: list[int]) -> dict[int, list[int]]:
        """Row -> tokens copied from its own context, for rows where a lookup finds any."""
        if self.lookup_sizes is None:
            return {}
        if self.draft is not None:  # beside a draft model, only where lookups have paid as well
            rows = [i for i in rows if batch.seqs[i].draft_sources.prefers_lookup()]
        found = {i: lookup(batch.seqs[i].token_ids, batch.num_spec_tokens[i], *self.lookup_sizes) for i in rows}
        return {i: toks for i, toks in found.items() if toks}

    def _draft_catch_up(self, batch: ScheduledBatch, model_rows: list[int]) -> torch.Tensor | None:
        """One draft forward over prefill chunks and each model row's missed tokens; the logits
        of the model rows' last positions (None when the draft had nothing to run)."""
        if self.draft is None or self.draft_kv is None:
            return None
        self.last_draft_catch_up = max(
            (batch.seqs[i].num_tokens - batch.seqs[i].draft_num_computed_tokens for i in model_rows), default=0
        )
        seqs, starts, toks, logit_rows = [], [], [], []
        for i, seq in enumerate(batch.seqs):
            if i not in model_rows and seq.is_decoding:
                continue  # decode steps without the draft leave it behind; it catches up when it next proposes
            start = seq.draft_num_computed_tokens
            end = seq.num_tokens if i in model_rows else seq.num_computed_tokens + batch.num_new_tokens[i]
            if end <= start:
                continue
            seqs.append(seq)
            starts.append(start)
            toks.append(seq.token_ids[start:end])
            logit_rows.append([end - start - 1] if i in model_rows else [])
            seq.draft_num_computed_tokens = end
        if not seqs:
            return None
        logits = self.draft.forward(build_forward(seqs, starts, toks, logit_rows), self.draft_kv)
        self.num_draft_forwards += 1
        return logits

    def _merge(self, batch: ScheduledBatch, looked: dict[int, list[int]], drafted: Proposal | None) -> Proposal | None:
        """One proposal from the looked-up rows and the draft model's. A looked-up token is a
        certain guess, so its q is one-hot: rejection sampling then accepts it with probability
        p(token) and redraws from p without it, which keeps sampled outputs exact."""
        if not looked:
            return drafted
        rows = sorted([*looked, *(drafted.rows if drafted else [])])
        counts = torch.tensor([len(looked[i]) if i in looked else 0 for i in rows])
        tokens = torch.zeros(
            len(rows), max(int(counts.max()), drafted.tokens.shape[1] if drafted else 0), dtype=torch.long
        )
        for j, i in enumerate(rows):
            if i in looked:
                tokens[j, : len(looked[i])] = torch.tensor(looked[i])
        if drafted is not None:
            at = [rows.index(i) for i in drafted.rows]
            tokens[at, : drafted.tokens.shape[1]] = drafted.tokens
            counts[at] = drafted.counts
        probs = None
        if not all(batch.seqs[i].params.greedy for i in rows):
            probs = self._one_hot(tokens, counts)
            if drafted is not None and drafted.probs is not None:
                probs[at, : drafted.tokens.shape[1]] = drafted.probs
        return Proposal(rows=rows, tokens=tokens, probs=probs, counts=counts, looked_up=[i in looked for i in rows])

    def _one_hot(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """q for certain guesses: [S, k, V], one at each real draft token, zero past a row's count."""
        probs = torch.zeros(*tokens.shape, self.target.lm_head.shape[0])
        probs.scatter_(2, tokens[..., None], 1.0)
        return probs * (torch.arange(tokens.shape[1])[None, :] < counts[:, None])[..., None]

    def _draft_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of draft logit columns (they differ when the draft's head is restricted)."""
        ids = self.draft.head_ids if self.draft is not None else None
        return columns if ids is None else ids[columns]

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary: -inf for ids outside a restricted head."""
        ids = self.draft.head_ids if self.draft is not None else None
        if ids is None:
            return logits
        full = torch.full((logits.shape[0], self.target.lm_head.shape[0]), float("-inf"), dtype=logits.dtype)
        return full.index_copy_(1, ids, logits)

    def _draft_sample(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft token and its processed distribution q for each row."""
        probs = process_logits(self._full_vocab(logits), *param_tensors(params))
        return sample(probs, gens, self.generator), probs

    def _propose_rest(
        self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor, generators: dict[str, torch.Generator]
    ) -> Proposal:
        """Sample d_1 from the first draft forward, then one forward per further draft token."""
        seqs = [batch.seqs[i] for i in rows]
        counts = torch.tensor([batch.num_spec_tokens[i] for i in rows])
        kmax = int(counts.max())
        params = [s.params for s in seqs]
        gens = [generators.get(s.request_id) for s in seqs]
        if all(p.greedy for p in params):
            return self._propose_greedy(seqs, rows, logits, counts)
        tokens = torch.zeros(len(rows), kmax, dtype=torch.long)
        probs = torch.zeros(len(rows), kmax, self.target.lm_head.shape[0])
        tokens[:, 0], probs[:, 0] = self._draft_sample(logits, params, gens)
        for j in range(1, kmax):
            live = [r for r in range(len(rows)) if counts[r] > j]
            fb = build_forward(
                [seqs[r] for r in live],
                [seqs[r].num_tokens + j - 1 for r in live],
                [[int(tokens[r, j - 1])] for r in live],
                [[0] for _ in live],
            )
            step_logits = self.draft.forward(fb, self.draft_kv)
            self.num_draft_forwards += 1
            t, p = self._draft_sample(step_logits, [params[r] for r in live], [gens[r] for r in live])
            tokens[live, j], probs[live, j] = t, p
        return Proposal(rows=rows, tokens=tokens, probs=probs, counts=counts)

    def _propose_greedy(
        self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor, counts: torch.Tensor
    ) -> Proposal:
        """Argmax drafts without distributions: for greedy rows q is one-hot, so verification
        needs only the tokens, and the [S, k, V] probabilities and noise are never built."""
        kmax = int(counts.max())
        tokens = torch.zeros(len(rows), kmax, dtype=torch.long)
        tokens[:, 0] = self._draft_ids(logits.argmax(-1))
        for j in range(1, kmax):
            live = [r for r in range(len(rows)) if counts[r] > j]
            fb = build_forward(
                [seqs[r] for r in live],
                [seqs[r].num_tokens + j - 1 for r in live],
                [[int(tokens[r, j - 1])] for r in live],
                [[0] for _ in live],
            )
            tokens[live, j] = self._draft_ids(self.draft.forward(fb, self.draft_kv).argmax(-1))
            self.num_draft_forwards += 1
        return Proposal(rows=rows, tokens=tokens, probs=None, counts=counts)

    # ----------------------------------------------------------------- target
    def score(self, batch: ScheduledBatch, proposal: Proposal | None) -> TargetOutput:
        """One target forward over every scheduled chunk plus the draft tokens to verify."""
        spec_of = {row: j for j, row in enumerate(proposal.rows)} if proposal else {}
        starts, toks, logit_rows, sample_rows = [], [], [], []
        for i, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.num_new_tokens[i]
            chunk = seq.token_ids[start : start + n]
            if i in spec_of:
                j = spec_of[i]
                chunk = chunk + proposal.tokens[j, : int(proposal.counts[j])].tolist()
                logit_rows.append(list(range(len(chunk))))
            elif start + n == seq.num_tokens:
                logit_rows.append([n - 1])
                sample_rows.append(i)
            else:
                logit_rows.append([])
            starts.append(start)
            toks.append(chunk)
        fb = build_forward(batch.seqs, starts, toks, logit_rows)
        logits = self.target.forward(fb, self.target_kv, reuse_logits=True)  # consumed within this step
        self.num_target_forwards += 1
        return self._split_logits(batch, logits, logit_rows, sample_rows, spec_of)

    @staticmethod
    def _split_logits(
        batch: ScheduledBatch,
        logits: torch.Tensor,
        logit_rows: list[list[int]],
        sample_rows: list[int],
        spec_of: dict[int, int],
    ) -> TargetOutput:
        """Separate rows to sample plainly from per-speculator verification blocks."""
        sample_idx: list[int] = []
        spec_blocks: list[torch.Tensor] = [logits[:0]] * len(spec_of)
        offset = 0
        for i in range(len(batch.seqs)):
            n = len(logit_rows[i])
            if i in spec_of:
                spec_blocks[spec_of[i]] = logits[offset : offset + n]
            elif n:
                sample_idx.append(offset)
            offset += n
        if sample_idx == list(range(logits.shape[0])):
            return TargetOutput(sample_rows, logits, spec_blocks)  # common decode step: no copy
        return TargetOutput(sample_rows, logits[sample_idx], spec_blocks)

    def verify(
        self,
        proposal: Proposal,
        spec_logits: list[torch.Tensor],
        seqs: list[Sequence],
        generators: dict[str, torch.Generator],
    ) -> RejectionResult:
        """Rejection-sample every speculator's drafts against the target's distributions."""
        if proposal.probs is None:
            return greedy_verify(proposal.tokens, [argmax_ids(block) for block in spec_logits], proposal.counts)
        kmax = proposal.tokens.shape[1]
        vocab = spec_logits[0].shape[-1]
        target = torch.zeros(len(seqs), kmax + 1, vocab)
        for j, (block, seq) in enumerate(zip(spec_logits, seqs)):
            t, k, p = param_tensors([seq.params] * block.shape[0])
            target[j, : block.shape[0]] = process_logits(block, t, k, p)
        gens = [generators.get(s.request_id) for s in seqs]
        return rejection_sample(proposal.tokens, proposal.probs, target, proposal.counts, gens, self.generator)
