"""`LLM`: the serving engine's public entry point (offline `generate` and the step API).

One step = schedule (scheduler, no torch) -> optional draft proposals -> one target forward ->
sample or verify -> bookkeeping. All state lives in the `LLM` instance and is passed down
explicitly; there is no global context, so several engines can live in one process (the
benchmark runs the engine with and without a draft side by side).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serve import cpu_kernels, decode_graphs, device_io
from serve.args import EngineArgs
from serve.attention.backend import get_backend
from serve.block_manager import BlockManager, blocks_to_hold
from serve.config import ModelConfig
from serve.detokenizer import StopMatcher
from serve.model import DecoderModel, resolve_dtype
from serve.runner import ModelRunner, Proposal, TargetOutput
from serve.sampler import Sampler, SamplingParams
from serve.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from serve.sequence import Sequence, SequenceStatus
from serve.spec_decode import SpecController
from serve.spec_window import source_key
from serve.stats import EngineStats
from serve.tokenizer import Tokenizer, first_vocab_difference
from serve.weights import DRAFT_VOCAB_FILE, read_draft_vocab

log = logging.getLogger("serve.engine")
Prompt = str | list[int]
NewTokens = dict[int, list[tuple[int, dict[int, float] | None]]]  # batch row -> (token, logprobs) in order


@dataclass
class RequestOutput:
    """A request's state after a step. `text` is filled once the request finished."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    error: str | None = None  # set when finish_reason is "error": why the engine failed this request


class _BatchFailure(Exception):
    """Computing a batch raised; the batch's sequences were restored to their state before it."""

    def __init__(self, seqs: list[Sequence], cause: Exception) -> None:
        super().__init__(repr(cause))
        self.seqs = seqs
        self.cause = cause


class LLM:
    """Load a Llama-family model (optionally a draft) and serve requests on CPU."""

    def __init__(
        self,
        model_dir: str | Path,
        draft_dir: str | Path | None = None,
        args: EngineArgs | None = None,
        **overrides: object,
    ) -> None:
        """Load the target (and draft) with `args`, or with `EngineArgs(**overrides)`: the
        keyword form (`LLM(path, dtype="float32", block_size=8)`) is the same options spelled
        inline. `device="cuda"` puts weights, KV cache and sampling on the GPU with the Triton
        kernels and CUDA graphs for decode steps (docs/gpu.md says what of it has run on a GPU)."""
        if args is None:
            args = EngineArgs(**overrides)  # type: ignore[arg-type]
        elif overrides:
            raise ValueError(f"pass either args or keyword options, not both (got {sorted(overrides)})")
        self.args = args
        self._draft_vocab_size = args.draft_vocab_size
        torch_dtype = resolve_dtype(args.dtype)
        self.config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
        self._device = args.device
        self._backend = get_backend(args.device, prefer=args.attention_backend)
        target = DecoderModel.load(
            model_dir, torch_dtype, self._backend, args.device, args.int4_activations, args.head_quant, args.head_screen
        )
        draft_dtype = resolve_dtype(args.draft_dtype) if args.draft_dtype else torch_dtype
        draft = self._load_draft(draft_dir, draft_dtype) if draft_dir is not None else None
        if draft is not None:
            draft.bind_kv_layout(target.kv_layout)  # the draft's layers share the target's block tables
        self.max_model_len = self._resolve_max_len(args.max_model_len)
        block_size = args.block_size
        num_blocks = self._num_blocks(args, target, draft)
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            args.enable_prefix_caching,
            group_windows=target.kv_layout.group_windows,
            max_chunk_tokens=args.max_num_batched_tokens,
            track_draft=draft is not None,
        )
        sched_cfg = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=args.max_waiting,
            max_tokens_in_flight=args.max_tokens_in_flight,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager)
        draft_kv = draft.new_kv_cache(num_blocks, block_size) if draft else None
        lookup = (args.prompt_lookup_min, args.prompt_lookup_max) if args.prompt_lookup_max else None
        self.runner = ModelRunner(
            target, target.new_kv_cache(num_blocks, block_size), draft, draft_kv, args.seed, lookup
        )
        if args.cuda_graphs and torch.device(args.device).type == "cuda":
            self._capture_graphs(args.max_num_seqs)
        speculates = draft is not None or lookup is not None
        self.spec = SpecController(args.num_speculative_tokens, args.adaptive_speculation) if speculates else None
        self.sampler = Sampler(args.seed)
        self.stats = EngineStats()
        self._generators: dict[str, torch.Generator] = {}
        self._logprobs: dict[str, list[dict[int, float]]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._stops: dict[str, StopMatcher] = {}
        self._errors: dict[str, str] = {}
        self._ids = itertools.count()
        self._eos = self.tokenizer.eos_token_ids if self.tokenizer else set()
        self._step_spec = (0, 0)

    # ----------------------------------------------------------------- loading
    def _capture_graphs(self, max_batch: int) -> None:
        """CUDA graphs of the target's and the draft's decode forwards, in one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        r = self.runner
        decode_graphs.install(r.target, r.target_kv, max_batch, self.max_model_len, decode_graphs.cuda_capture, pool)
        if r.draft is not None and r.draft_kv is not None:
            decode_graphs.install(r.draft, r.draft_kv, max_batch, self.max_model_len, decode_graphs.cuda_capture, pool)

    def _load_draft(self, draft_dir: str | Path, dtype: torch.dtype) -> DecoderModel:
        """Load the draft and refuse it when its vocabulary differs from the target's."""
        draft_cfg = ModelConfig.from_dir(draft_dir)
        has_tok = (Path(draft_dir) / "tokenizer.json").is_file()
        if self.tokenizer is not None and has_tok:
            diff = first_vocab_difference(self.tokenizer, Tokenizer(draft_dir))
            if diff is not None:
                i, a, b = diff
                raise ValueError(
                    f"draft {draft_dir} has a different vocabulary from the target: first differing id {i} "
                    f"(target {a!r}, draft {b!r}); the draft must use the target's exact tokenizer"
                )
        if draft_cfg.vocab_size != self.config.vocab_size:
            first = min(draft_cfg.vocab_size, self.config.vocab_size)
            raise ValueError(
                f"draft {draft_dir} has vocab_size {draft_cfg.vocab_size}, the target {self.config.vocab_size}: first "
                f"differing id {first}; the draft must use the target's exact vocabulary"
            )
        draft = DecoderModel.load(draft_dir, dtype, self._backend, self._device, head_quant=self._draft_head_quant())
        vocab_file = Path(draft_dir) / DRAFT_VOCAB_FILE
        if vocab_file.is_file() and self._draft_vocab_size != 0:
            ids = read_draft_vocab(vocab_file)
            draft.restrict_head(ids[: self._draft_vocab_size] if self._draft_vocab_size else ids)
        return draft

    def _draft_head_quant(self) -> str:
        """The draft head's format: int8 wherever the int8 head can run, unless told otherwise.

        Why by default: a draft with a large vocabulary (or the served rows of one) reads its
        float32 head once per drafted token, about a third of a small draft's step; in int8 it
        reads a quarter of the bytes. The target verifies every drafted token, so outputs cannot
        change, only how many drafted tokens it accepts."""
        choice = self.args.draft_head_quant
        if self.args.head_quant == "int8" or choice == "int8":
            return "int8"
        if choice == "auto" and self._device == "cpu" and cpu_kernels.available():
            return "int8"
        return "none"

    @property
    def cpu_isa(self) -> str:
        """The ISA variant of serve's CPU kernels this engine runs ("none" off the CPU or without them)."""
        return cpu_kernels.isa() if self._device == "cpu" else "none"

    def _resolve_max_len(self, requested: int | None) -> int:
        """The served context length: the model's, or a smaller one the user asked for."""
        limit = self.config.max_model_len
        if requested is None:
            return limit
        if not 1 <= requested <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
        return requested

    def _num_blocks(self, args: EngineArgs, target: DecoderModel, draft: DecoderModel | None) -> int:
        """KV blocks from an explicit count or a memory budget (capped at what max_num_seqs can use).

        A block holds one block group's layers (`serve.kv_layout`), in the target and the draft.
        """
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        memory_gb, block_size, max_seqs = args.kv_cache_memory_gb, args.block_size, args.max_num_seqs
        per_block = target.kv_bytes_per_block(block_size)
        if draft is not None:
            per_block += draft.kv_bytes_per_block(block_size)
        windows = target.kv_layout.group_windows
        useful = max_seqs * blocks_to_hold(windows, block_size, self.max_model_len, args.max_num_batched_tokens) + 1
        return max(1, min(int(memory_gb * 2**30) // per_block, useful))

    # ----------------------------------------------------------------- requests
    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt (text or token ids); returns its id. Raises AdmissionError if refused."""
        params = sampling_params or SamplingParams()
        ids = self._encode(prompt)
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if params.top_k > self.config.vocab_size:
            raise ValueError(
                f"top_k must be -1 (disabled) or at most the vocabulary size {self.config.vocab_size}, "
                f"got {params.top_k}"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        # everything that can fail happens before the scheduler holds the request, so a refused
        # request never stays behind in the engine
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(rid, ids, params.max_tokens, time.perf_counter(), params=params)
        seq.spec_allowed = not params.has_penalties and params.logprobs is None
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        if generator is not None:
            self._generators[rid] = generator
        return rid

    def _encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text or token-id prompt."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model directory has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it was unknown or already done."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._release(seq)
        self._seqs.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        return True

    def abort_all(self) -> list[str]:
        """Abort every queued and running request (the server's last resort); returns their ids."""
        ids = [s.request_id for s in list(self.scheduler.running) + list(self.scheduler.waiting)]
        for rid in ids:
            self.abort(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run."""
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration; outputs for requests that advanced or finished.

        One request must not fail the others: if computing the batch raises, each of its
        requests is stepped again on its own, and only those that fail alone finish with
        finish_reason "error" (blocks freed, `RequestOutput.error` says why); the rest advance
        as usual. Greedy outputs are unchanged by the retry; a seeded request's draws may
        differ, as the failed attempt consumed some of its generator's noise.
        """
        try:
            return self._step_once()
        except _BatchFailure as failure:
            return self._isolate(failure.seqs, failure.cause)

    def _step_once(self) -> list[RequestOutput]:
        """Schedule, compute and commit one batch; raises _BatchFailure (state restored) if computing fails."""
        batch = self.scheduler.schedule(num_spec_tokens=self._plan_windows())
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if batch.is_empty:
            return []
        started = time.perf_counter()
        decode_only = all(s.is_decoding for s in batch.seqs)
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        saved = [(s.num_computed_tokens, s.draft_num_computed_tokens) for s in batch.seqs]
        try:
            self.runner.copy_blocks(self.block_manager.take_pending_copies())
            proposal = self.runner.propose(batch, self._generators)
            scored = self.runner.score(batch, proposal, self._generators)
            new_tokens = self._sample_plain(batch, scored)
            if proposal is not None:
                new_tokens.update(self._verify(batch, proposal, scored.spec_logits))
        except Exception as exc:
            for seq, (computed, draft_computed) in zip(batch.seqs, saved):
                seq.num_computed_tokens, seq.draft_num_computed_tokens = computed, draft_computed
            raise _BatchFailure(list(batch.seqs), exc) from exc
        outputs = self._commit(batch, new_tokens, proposal)
        self._record_step(batch, proposal, decode_only, time.perf_counter() - started)
        return outputs

    def _plan_windows(self) -> int:
        """Set each running request's draft window for this step; the largest (0: no speculation)."""
        running = self.scheduler.running
        decoding = [s for s in running if s.is_decoding]
        eligible = [s.request_id for s in decoding if s.spec_allowed]
        sched = self.scheduler
        admits = bool(sched.waiting) and len(running) < sched.config.max_num_seqs
        timed = len(decoding) == len(running) and not admits  # decode-only: the switch times it
        keys = {s.request_id: source_key(s.request_id, self.runner.looks_up(s)) for s in decoding if s.spec_allowed}
        plan = self.spec.plan([keys[r] for r in eligible], len(decoding), timed) if self.spec and eligible else {}
        for seq in running:
            seq.spec_window = plan.get(keys.get(seq.request_id, ""), 0)
        return max(plan.values(), default=0)

    def _isolate(self, seqs: list[Sequence], cause: Exception) -> list[RequestOutput]:
        """Step each request of a failed batch alone; fail only the ones that fail alone."""
        log.warning("a batch of %d requests failed (%r); retrying them one by one", len(seqs), cause)
        sched = self.scheduler
        running, waiting = sched.running, sched.waiting
        outputs: list[RequestOutput] = []
        culprits: list[tuple[Sequence, Exception]] = []
        try:
            for seq in seqs:
                if seq.is_finished:
                    continue
                sched.running = [seq] if seq.status is SequenceStatus.RUNNING else []
                sched.waiting = deque([seq] if seq.status is SequenceStatus.WAITING else [])
                try:
                    outputs.extend(self._step_once())
                except _BatchFailure as failure:
                    culprits.append((seq, failure.cause))
        finally:  # put every request back where it belongs, in its original order
            everyone = list(running) + list(waiting)
            sched.running = [s for s in everyone if s.status is SequenceStatus.RUNNING]
            sched.waiting = deque(s for s in everyone if s.status is SequenceStatus.WAITING)
        for seq, exc in culprits:
            log.error("request %s failed on its own and is aborted: %r", seq.request_id, exc)
            outputs.append(self._fail(seq, exc))
        return outputs

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Finish `seq` with status error (its blocks freed) and return its final output."""
        self._errors[seq.request_id] = f"{type(exc).__name__}: {exc}"
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        seq.status = SequenceStatus.FINISHED_ERROR
        self._release(seq)
        return self._output(seq, [])

    def _sample_plain(self, batch: ScheduledBatch, scored: TargetOutput) -> NewTokens:
        """Sample one token for every row that caught up without speculation."""
        if not scored.sample_rows:
            return {}
        seqs = [batch.seqs[i] for i in scored.sample_rows]
        result = self.sampler(
            scored.sample_logits,
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._generators.get(s.request_id) for s in seqs],
            scored.drawn,
        )
        return {row: [(tok, lp)] for row, tok, lp in zip(scored.sample_rows, result.tokens, result.logprobs)}

    def _verify(self, batch: ScheduledBatch, proposal: Proposal, spec_logits: list[torch.Tensor]) -> NewTokens:
        """Rejection-sample the drafts; roll both caches back past the rejected positions."""
        seqs = [batch.seqs[i] for i in proposal.rows]
        res = self.runner.verify(proposal, spec_logits, seqs, self._generators)
        out: NewTokens = {}
        # one read-back: each row's accepted count, then its emitted ids
        emitted = device_io.to_host(torch.cat([res.num_accepted[:, None], res.tokens], dim=1))
        self._step_spec = (sum(proposal.counts), sum(line[0] for line in emitted))
        for j, (row, seq) in enumerate(zip(proposal.rows, seqs)):
            m, k = emitted[j][0], proposal.counts[j]
            n = seq.num_tokens
            # target K/V is valid for the last token and the m accepted drafts; the draft wrote
            # positions up to n + k - 2. num_new_tokens (1) is added back in _commit.
            seq.num_computed_tokens = n + m - 1
            looked_up = bool(proposal.looked_up and proposal.looked_up[j])
            if not looked_up:  # a looked-up row left the draft where it was
                seq.draft_num_computed_tokens = min(n - 1 + k, n + m)
            out[row] = [(t, None) for t in emitted[j][1 : m + 2]]
            if self.spec is not None:
                self.spec.observe(source_key(seq.request_id, looked_up), k, m)
            self.stats.spec_proposed += k
            self.stats.spec_accepted += m
            self.stats.spec_verifications += 1
            self.stats.spec_emitted += m + 1
            seq.draft_sources.observe(looked_up, m)
            if looked_up:
                self.stats.lookup_proposed += k
                self.stats.lookup_accepted += m
        return out

    def _commit(self, batch: ScheduledBatch, new_tokens: NewTokens, proposal: Proposal | None) -> list[RequestOutput]:
        """Advance computed counts, append tokens, apply stop rules, free or trim blocks."""
        outputs: list[RequestOutput] = []
        spec_rows = set(proposal.rows) if proposal else set()
        now = time.perf_counter()
        for i, seq in enumerate(batch.seqs):
            try:
                output = self._commit_one(seq, batch, i, new_tokens.get(i, []), i in spec_rows, now)
            except Exception as exc:  # bookkeeping of one request (its stop strings, say) fails it alone
                log.exception("request %s failed while committing its tokens", seq.request_id)
                output = self._fail(seq, exc)
            if output is not None:
                outputs.append(output)
        return outputs

    def _commit_one(
        self,
        seq: Sequence,
        batch: ScheduledBatch,
        i: int,
        tokens: list[tuple[int, dict[int, float] | None]],
        speculated: bool,
        now: float,
    ) -> RequestOutput | None:
        """Commit row `i` of the batch; its output if it advanced or finished."""
        seq.num_computed_tokens += batch.num_new_tokens[i]
        appended: list[int] = []
        for token, logprob in tokens:
            appended.append(token)
            if self._append(seq, token, logprob, now):
                break
        if seq.is_finished:
            self._release(seq)
        else:
            if speculated or batch.num_spec_tokens[i]:
                self.block_manager.trim(seq, seq.num_tokens)
            ready = (
                min(seq.num_computed_tokens, seq.draft_num_computed_tokens)
                if self.runner.draft is not None
                else seq.num_computed_tokens
            )
            self.block_manager.cache_full_blocks(seq, ready)
        return self._output(seq, appended) if appended or seq.is_finished else None

    def _append(self, seq: Sequence, token: int, logprob: dict[int, float] | None, now: float) -> bool:
        """Append one generated token; returns True when it finished the request."""
        seq.token_ids.append(token)
        self.stats.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            self._logprobs.setdefault(seq.request_id, []).append(logprob)
        params: SamplingParams = seq.params
        status = None
        if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif params.stop and self.tokenizer is not None and self._hit_stop_string(seq, params, token):
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is None:
            return False
        seq.finish_time = now
        self.scheduler.finish(seq, status)
        return True

    def _hit_stop_string(self, seq: Sequence, params: SamplingParams, token: int) -> bool:
        """Check stop strings on the new tail of the output; cut the text at the first one found."""
        matcher = self._stops.get(seq.request_id)
        if matcher is None:
            assert self.tokenizer is not None and params.stop
            matcher = StopMatcher(self.tokenizer.decode, list(params.stop), params.include_stop_str_in_output)
            for earlier in seq.output_token_ids[:-1]:  # normally none: the matcher starts with the first token
                matcher.text.add([earlier])
            self._stops[seq.request_id] = matcher
        hit = matcher.add(token)
        if hit is None:
            return False
        seq.output_text, seq.stop_reason = hit
        return True

    def _release(self, seq: Sequence) -> None:
        """Book a finished request's latencies and drop its per-request state."""
        self.stats.record_request(
            seq.arrival_time,
            seq.first_scheduled_time,
            seq.first_token_time,
            seq.finish_time or time.perf_counter(),
            seq.num_output_tokens,
        )
        stopped_by_string = isinstance(seq.stop_reason, str)  # its text was already cut at the stop string
        if not stopped_by_string and self.tokenizer is not None:
            seq.output_text = self.tokenizer.decode(seq.output_token_ids)
        self._generators.pop(seq.request_id, None)
        if self.spec is not None:
            self.spec.forget(seq.request_id)
        self._stops.pop(seq.request_id, None)

    def _output(self, seq: Sequence, appended: list[int]) -> RequestOutput:
        """The public view of `seq` after this step; finished requests leave the engine's maps."""
        finished = seq.is_finished
        if finished:
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=appended,
            finished=finished,
            finish_reason=seq.status.value if finished else None,
            text=seq.output_text if finished else "",
            error=self._errors.pop(seq.request_id, None) if finished else None,
            logprobs=self._logprobs.pop(seq.request_id, [])
            if finished
            else list(self._logprobs.get(seq.request_id, [])),
        )

    def _record_step(self, batch: ScheduledBatch, proposal: Proposal | None, decode_only: bool, seconds: float) -> None:
        """Step counters, KV usage and waste, and timings for the speculation switch."""
        st, bm = self.stats, self.block_manager
        st.num_steps += 1
        st.prefix_query_tokens = self.scheduler.prefix_query_tokens
        st.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        st.kv_usage_peak = max(st.kv_usage_peak, bm.usage)
        st.kv_usage_sum += bm.usage
        for seq in self.scheduler.running:
            allocated = len(seq.block_table) * bm.block_size
            st.kv_allocated_slots += allocated
            st.kv_used_slots += min(seq.num_tokens, allocated)
            st.kv_reserved_request_slots += seq.max_total_tokens
            st.kv_reserved_max_len_slots += self.max_model_len
        if proposal is not None:
            st.spec_steps += 1
        elif decode_only:
            st.plain_decode_steps += 1
        if self.spec is not None and decode_only:
            if proposal is not None:
                proposed, accepted = self._step_spec
                steady = self.runner.last_draft_catch_up <= 2  # 1 normally, 2 after all drafts were accepted
                lookup_only = bool(proposal.looked_up) and all(proposal.looked_up)
                self.spec.record_spec(len(batch.seqs), seconds if steady else None, proposed, accepted, lookup_only)
            else:
                self.spec.record_plain(len(batch.seqs), seconds)

    # ----------------------------------------------------------------- offline
    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of `prompts`."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        items: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(items)
        )
        if len(params) != len(items):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(items)} prompts; give one or one per prompt"
            )
        ids = [self.add_request(p, sp) for p, sp in zip(items, params)]
        wanted, done = set(ids), {}
        while wanted - done.keys():
            outputs = self.step()
            if not outputs and not self.scheduler.running and self.scheduler.waiting:
                raise RuntimeError(
                    "the scheduler cannot admit the next waiting request (engine bug: admission should have refused it)"
                )
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]
