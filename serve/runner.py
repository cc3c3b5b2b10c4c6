"""Turns a scheduled batch into forwards: draft proposals, the target forward, verification.

Separated from `engine.py` so that the engine keeps request bookkeeping and this module keeps
tensor work. Everything a call needs is passed in; the runner owns only the models, their KV
caches and the default random generator. Tensors live on the target's device; host values
reach it through `serve.device_io`, and only sampled ids come back (once per forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve import device_io
from serve.attention import SeqChunk
from serve.kv_cache import KVCache
from serve.model import DecoderModel, ForwardBatch
from serve.prompt_lookup import lookup
from serve.sampler import GumbelDraw, SamplingParams, argmax_ids, gumbel_noise, processed, sample
from serve.scheduler import ScheduledBatch
from serve.sequence import Sequence
from serve.spec_decode import RejectionResult, greedy_verify, rejection_sample


@dataclass
class Proposal:
    """Draft tokens for the speculating rows of a batch (row i of the batch -> index here)."""

    rows: list[int]
    tokens: torch.Tensor  # [S, kmax] (padding 0), on the device
    probs: torch.Tensor | None  # [S, kmax, V] (padding 0); None when every speculating row is greedy
    counts: list[int]  # [S] real drafts per row (host: the step plans with them)
    looked_up: list[bool] | None = None  # per row: drafted by prompt lookup (None: all by the draft model)


@dataclass
class TargetOutput:
    """Logits of the target forward: `last[i]` row for sampled rows, `spec[j]` rows per speculator."""

    sample_rows: list[int]  # batch rows that caught up without speculation
    sample_logits: torch.Tensor  # [len(sample_rows), V]
    spec_logits: list[torch.Tensor]  # per proposal row: [k_i + 1, V]
    drawn: bool = False  # every row's token is the argmax of its row (greedy, or a Gumbel draw)


def build_forward(
    seqs: list[Sequence], starts: list[int], token_lists: list[list[int]], logits_rows: list[list[int]]
) -> ForwardBatch:
    """Flat batch from per-sequence chunks; `logits_rows[i]` are offsets within chunk i.

    Its tensors are built on the host and staged by the model's forward (`serve.device_io`)."""
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
    with device_io.staging():
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
        self.device = target.device
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
        rows = [i for i in rows if self._may_look_up(batch.seqs[i])]
        found = {i: self._lookup(batch.seqs[i], batch.num_spec_tokens[i]) for i in rows}
        return {i: toks for i, toks in found.items() if toks}

    def _may_look_up(self, seq: Sequence) -> bool:
        """Whether `seq` tries a lookup at all: lookup is on and, beside a draft model, has paid
        for this request at least as well."""
        return self.lookup_sizes is not None and (self.draft is None or seq.draft_sources.prefers_lookup())

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens a prompt lookup copies from `seq`'s context (none where it finds none)."""
        assert self.lookup_sizes is not None
        return lookup(seq.token_ids, k, *self.lookup_sizes)

    def looks_up(self, seq: Sequence) -> bool:
        """Whether prompt lookup, not the draft model, would propose for `seq` this step (a
        lookup that finds an n-gram finds it at any window): the engine plans its window from
        the lookup's own acceptance record then."""
        return self._may_look_up(seq) and bool(self._lookup(seq, 1))

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
        drafted_of = dict(zip(drafted.rows, drafted.counts)) if drafted else {}
        counts = [len(looked[i]) if i in looked else drafted_of[i] for i in rows]
        width = max(max(counts), drafted.tokens.shape[1] if drafted else 0)
        padded = [looked.get(i, []) + [0] * (width - len(looked.get(i, []))) for i in rows]
        tokens = device_io.tensor(padded, torch.long, self.device)
        if drafted is not None:
            at = device_io.tensor([rows.index(i) for i in drafted.rows], torch.long, self.device)
            tokens[at, : drafted.tokens.shape[1]] = drafted.tokens
        probs = None
        if not all(batch.seqs[i].params.greedy for i in rows):
            probs = self._one_hot(tokens, counts)
            if drafted is not None and drafted.probs is not None:
                probs[at, : drafted.tokens.shape[1]] = drafted.probs
        return Proposal(rows=rows, tokens=tokens, probs=probs, counts=counts, looked_up=[i in looked for i in rows])

    def _one_hot(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """q for certain guesses: [S, k, V], one at each real draft token, zero past a row's count."""
        probs = torch.zeros(*tokens.shape, self.target.lm_head.shape[0], device=self.device)
        probs.scatter_(2, tokens[..., None], 1.0)
        real = torch.arange(tokens.shape[1], device=self.device)[None, :] < self._counts(counts)[:, None]
        return probs * real[..., None]

    def _counts(self, counts: list[int]) -> torch.Tensor:
        """Per-row draft counts as a device tensor."""
        return device_io.tensor(counts, torch.long, self.device)

    def _draft_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of draft logit columns (they differ when the draft's head is restricted)."""
        ids = self.draft.head_ids if self.draft is not None else None
        return columns if ids is None else ids[columns]

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary: -inf for ids outside a restricted head."""
        ids = self.draft.head_ids if self.draft is not None else None
        if ids is None:
            return logits
        vocab = self.target.lm_head.shape[0]
        full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        return full.index_copy_(1, ids, logits)

    def _draft_sample(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft token and its processed distribution q for each row."""
        probs = processed(self._full_vocab(logits), params)
        return sample(probs, gens, self.generator), probs

    def _propose_rest(
        self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor, generators: dict[str, torch.Generator]
    ) -> Proposal:
        """Sample d_1 from the first draft forward, then one forward per further draft token."""
        seqs = [batch.seqs[i] for i in rows]
        counts = [batch.num_spec_tokens[i] for i in rows]
        params = [s.params for s in seqs]
        gens = [generators.get(s.request_id) for s in seqs]
        if all(p.greedy for p in params):
            return self._propose_greedy(seqs, rows, logits, counts)
        tokens = torch.zeros(len(rows), max(counts), dtype=torch.long, device=self.device)
        probs = torch.zeros(len(rows), max(counts), self.target.lm_head.shape[0], device=self.device)
        tokens[:, 0], probs[:, 0] = self._draft_sample(logits, params, gens)
        for j in range(1, max(counts)):
            live = [r for r in range(len(rows)) if counts[r] > j]
            step_logits = self._draft_step(seqs, tokens, live, j)
            t, p = self._draft_sample(step_logits, [params[r] for r in live], [gens[r] for r in live])
            at = self._rows(live, len(rows))
            tokens[at, j], probs[at, j] = t, p
        return Proposal(rows=rows, tokens=tokens, probs=probs, counts=counts)

    def _draft_step(self, seqs: list[Sequence], tokens: torch.Tensor, live: list[int], j: int) -> torch.Tensor:
        """Draft logits of position j for rows `live`, fed their draft token j - 1 (read back:
        the sampled ids the next forward's input is built from)."""
        previous = device_io.to_host(tokens[:, j - 1])
        fb = build_forward(
            [seqs[r] for r in live],
            [seqs[r].num_tokens + j - 1 for r in live],
            [[previous[r]] for r in live],
            [[0] for _ in live],
        )
        self.num_draft_forwards += 1
        return self.draft.forward(fb, self.draft_kv)

    def _rows(self, live: list[int], total: int) -> torch.Tensor | slice:
        """Index of rows `live` of a [total, ...] device tensor (a slice when all are live)."""
        return slice(None) if len(live) == total else device_io.tensor(live, torch.long, self.device)

    def _propose_greedy(
        self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor, counts: list[int]
    ) -> Proposal:
        """Argmax drafts without distributions: for greedy rows q is one-hot, so verification
        needs only the tokens, and the [S, k, V] probabilities and noise are never built."""
        tokens = torch.zeros(len(rows), max(counts), dtype=torch.long, device=self.device)
        tokens[:, 0] = self._draft_ids(logits.argmax(-1))
        for j in range(1, max(counts)):
            live = [r for r in range(len(rows)) if counts[r] > j]
            tokens[self._rows(live, len(rows)), j] = self._draft_ids(self._draft_step(seqs, tokens, live, j).argmax(-1))
        return Proposal(rows=rows, tokens=tokens, probs=None, counts=counts)

    # ----------------------------------------------------------------- target
    def score(
        self, batch: ScheduledBatch, proposal: Proposal | None, generators: dict[str, torch.Generator]
    ) -> TargetOutput:
        """One target forward over every scheduled chunk plus the draft tokens to verify."""
        spec_of = {row: j for j, row in enumerate(proposal.rows)} if proposal else {}
        drafts = device_io.to_host(proposal.tokens) if proposal else []  # the drafts' sampled ids
        starts, toks, logit_rows, sample_rows = [], [], [], []
        for i, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.num_new_tokens[i]
            chunk = seq.token_ids[start : start + n]
            if i in spec_of:
                j = spec_of[i]
                chunk = chunk + drafts[j][: proposal.counts[j]]
                logit_rows.append(list(range(len(chunk))))
            elif start + n == seq.num_tokens:
                logit_rows.append([n - 1])
                sample_rows.append(i)
            else:
                logit_rows.append([])
            starts.append(start)
            toks.append(chunk)
        fb = build_forward(batch.seqs, starts, toks, logit_rows)
        draw = self._gumbel_draw(batch, logit_rows, spec_of, generators)
        argmax_only = draw is not None or all(s.params.argmax_only for s, rows in zip(batch.seqs, logit_rows) if rows)
        logits = self.target.forward(fb, self.target_kv, reuse_logits=True, argmax_only=argmax_only, draw=draw)
        self.num_target_forwards += 1
        out = self._split_logits(batch, logits, logit_rows, sample_rows, spec_of)
        out.drawn = draw is not None
        return out

    def _gumbel_draw(
        self,
        batch: ScheduledBatch,
        logit_rows: list[list[int]],
        spec_of: dict[int, int],
        generators: dict[str, torch.Generator],
    ) -> GumbelDraw | None:
        """Noise that makes each sampled row's token an argmax, for a CPU step whose logits rows
        are all plain draws (`SamplingParams.gumbel_sampled`, not verifying drafts) or greedy
        argmax-only rows; None otherwise (the sampler then draws by inverse CDF). Every plain draw
        on the CPU is a Gumbel draw, screened head or not, so the same seed gives the same tokens
        with `--no-head-screen`."""
        rows = [(i, seq.params) for i, seq in enumerate(batch.seqs) if logit_rows[i]]
        if self.target.device.type != "cpu" or not any(p.gumbel_sampled for _, p in rows):
            return None
        if not all(p.argmax_only or (p.gumbel_sampled and i not in spec_of) for i, p in rows):
            return None
        starts = [0]
        for r in logit_rows:
            starts.append(starts[-1] + len(r))
        sampled = [(i, p) for i, p in rows if p.gumbel_sampled]
        offsets = [starts[i] for i, _ in sampled]
        n, vocab = starts[-1], self.target.lm_head.shape[0]
        temperature = torch.ones(n)
        temperature[offsets] = torch.tensor([p.temperature for _, p in sampled])
        noise = gumbel_noise([generators.get(batch.seqs[i].request_id) for i, _ in sampled], self.generator, vocab)
        if len(offsets) < n:  # greedy rows beside them: no noise
            noise = torch.zeros(n, vocab).index_copy_(0, torch.tensor(offsets), noise)
        return GumbelDraw(temperature, noise)

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
        picked = logits.index_select(0, device_io.tensor(sample_idx, torch.long, logits.device))
        return TargetOutput(sample_rows, picked, spec_blocks)

    def verify(
        self,
        proposal: Proposal,
        spec_logits: list[torch.Tensor],
        seqs: list[Sequence],
        generators: dict[str, torch.Generator],
    ) -> RejectionResult:
        """Rejection-sample every speculator's drafts against the target's distributions."""
        kmax = proposal.tokens.shape[1]
        counts = self._counts(proposal.counts)
        if proposal.probs is None:
            best = torch.zeros(len(seqs), kmax + 1, dtype=torch.long, device=self.device)
            for j, block in enumerate(spec_logits):
                best[j, : block.shape[0]] = argmax_ids(block)
            return greedy_verify(proposal.tokens, best, counts)
        target = torch.zeros(len(seqs), kmax + 1, spec_logits[0].shape[-1], device=self.device)
        for j, (block, seq) in enumerate(zip(spec_logits, seqs)):
            target[j, : block.shape[0]] = processed(block, [seq.params] * block.shape[0])
        gens = [generators.get(s.request_id) for s in seqs]
        return rejection_sample(proposal.tokens, proposal.probs, target, counts, gens, self.generator)
