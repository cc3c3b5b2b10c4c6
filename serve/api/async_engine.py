"""`AsyncEngine`: the `LLM` stepped by ONE dedicated thread, fed and drained from asyncio.

Why a thread and not the event loop: a step is torch work that takes milliseconds to seconds;
on the loop it would stall every connection. Why one thread: the engine is not thread-safe and
needs no locks if a single thread owns it. HTTP handlers therefore never call the `LLM`; they
post commands (add, abort) to an inbox and the engine thread executes them between steps,
answering through futures and per-request asyncio queues via `loop.call_soon_threadsafe`.
Text is detokenised incrementally in this thread too, so handlers only format JSON.

Failure containment: a request the engine fails on its own (`finish_reason` "error") gets an
`EngineError` naming it while the others continue; if the engine thread itself dies, every
waiting client gets an error at once, new requests are refused (`alive` is False, /health
answers 503) and nothing is left queued without a reader.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serve.api.metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Histogram, MetricsSnapshot
from serve.detokenizer import IncrementalText
from serve.engine import LLM, RequestOutput
from serve.sampler import SamplingParams
from serve.scheduler import AdmissionError

log = logging.getLogger("serve.api")


@dataclass
class Delta:
    """What one step added to one request (text is safe to show: no half characters)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class EngineError(RuntimeError):
    """The engine failed while running a request (an engine bug, reported as HTTP 500)."""


@dataclass
class _Stream:
    """Per-request state the engine thread keeps while the request runs."""

    queue: asyncio.Queue
    text: IncrementalText
    num_logprobs: int = 0


@dataclass
class _Counters:
    """Server-side totals the engine's own stats do not keep."""

    finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    rejected: int = 0
    seen_ttft: int = 0
    seen_tpot: int = 0
    seen_e2e: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


class AsyncEngine:
    """Own an `LLM` in a background thread; add, stream and abort requests from asyncio."""

    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._dead: str | None = None  # why the engine thread ended, once it has
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counters = _Counters()
        self.cpu_isa = llm.cpu_isa
        self.snapshot = MetricsSnapshot(
            model_name,
            num_kv_blocks=llm.block_manager.num_blocks,
            num_free_kv_blocks=llm.block_manager.num_free_blocks,
            cpu_isa=self.cpu_isa,
        )

    # ----------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; results are delivered on `loop`."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the engine thread to finish and wait for it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and accepts work."""
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- asyncio side
    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; returns its delta queue. Raises AdmissionError or ValueError if refused."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._post(("add", (request_id, prompt_ids, params, queue, future)))
        await future
        return queue

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        self._post(("abort", request_id))

    def _post(self, command: tuple[str, Any]) -> None:
        with self._cv:
            if self._dead is not None:
                if command[0] == "add":
                    raise EngineError(f"the engine is not running ({self._dead})")
                return  # an abort after death: the request was already failed
            self._inbox.append(command)
            self._cv.notify()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        """Run the loop; if it ever raises, fail every request and refuse new ones."""
        reason = "the server is shutting down"
        try:
            self._loop_forever()
        except BaseException as exc:  # the last line of defence: nobody may wait forever
            log.exception("the engine thread died")
            reason = f"the engine thread died: {exc!r}"
        with self._cv:
            self._dead = reason
        self._fail_all(EngineError(reason))

    def _loop_forever(self) -> None:
        """The loop: execute commands, step while work exists, sleep when idle."""
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not self.llm.has_unfinished_requests():
                    self._cv.wait()
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, []
            for kind, arg in commands:
                self._add(*arg) if kind == "add" else self._abort(arg)
            if self.llm.has_unfinished_requests():
                self._step()
            self._publish()

    def _add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        future: asyncio.Future,
    ) -> None:
        try:
            self.llm.add_request(prompt_ids, params, request_id)
        except Exception as exc:  # AdmissionError/ValueError are the client's; anything else is ours (500)
            if isinstance(exc, AdmissionError) and exc.retryable:
                self._counters.rejected += 1
            if not isinstance(exc, ValueError):
                log.exception("add_request failed")
                exc = EngineError(f"could not add the request: {exc!r}")
            self.llm.abort(request_id)  # never keep a refused request (a no-op when it was not queued)
            self._deliver([(future.set_exception, exc)])
            return
        holdback = max((len(s) for s in params.stop or []), default=1) - 1
        self._streams[request_id] = _Stream(queue, IncrementalText(self._decode, holdback))
        self._counters.prompt_tokens += len(prompt_ids)
        self._deliver([(future.set_result, None)])

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if self.llm.abort(request_id):
            self._bump("abort")
        if stream is not None:
            self._deliver([(stream.queue.put_nowait, EngineError(f"request {request_id} was aborted"))])

    def _decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids) if self.llm.tokenizer is not None else ""

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:  # the engine could not even isolate the failure: fail everything, keep serving
            log.exception("engine step failed; aborting every request")
            self._fail_all(EngineError(f"engine step failed: {exc!r}"))
            return
        if not outputs and not self.llm.scheduler.running and self.llm.scheduler.waiting:
            head = self.llm.scheduler.waiting[0].request_id  # nothing can run: refuse rather than spin
            log.error("request %s can never be scheduled; aborting it", head)
            stream = self._streams.pop(head, None)
            self.llm.abort(head)
            if stream is not None:
                self._deliver([(stream.queue.put_nowait, EngineError(f"request {head} cannot be scheduled"))])
            return
        calls = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason == "error":
                self._streams.pop(out.request_id, None)
                self._bump("error")
                calls.append((stream.queue.put_nowait, EngineError(out.error or "the engine failed")))
                continue
            calls.append((stream.queue.put_nowait, self._delta(stream, out)))
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._bump(out.finish_reason or "stop")
        self._deliver(calls)

    def _delta(self, stream: _Stream, out: RequestOutput) -> Delta:
        stream.text.add(out.new_token_ids)
        new_logprobs = out.logprobs[stream.num_logprobs :]
        stream.num_logprobs = len(out.logprobs)
        return Delta(
            text=stream.text.next_delta(out.text if out.finished else None),
            token_ids=list(out.new_token_ids),
            logprobs=new_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
        )

    def _fail_all(self, exc: Exception) -> None:
        """Answer every stream and pending admission with `exc` and empty the engine."""
        calls: list[tuple[Callable[[Any], None], Any]] = [(s.queue.put_nowait, exc) for s in self._streams.values()]
        self._streams.clear()
        try:
            for _ in self.llm.abort_all():
                self._bump("abort")
        except Exception:  # the engine is already broken; the clients are answered regardless
            log.exception("could not abort the engine's requests")
        with self._cv:
            for kind, arg in self._inbox:
                if kind == "add":
                    calls.append((arg[4].set_exception, exc))
            self._inbox.clear()
        self._deliver(calls)

    def _bump(self, reason: str) -> None:
        self._counters.finished[reason] = self._counters.finished.get(reason, 0) + 1

    def _deliver(self, calls: list[tuple[Callable[[Any], None], Any]]) -> None:
        """Run `fn(arg)` pairs on the event loop, in order, with one wake-up."""
        if not calls or self._loop is None:
            return

        def apply() -> None:
            for fn, arg in calls:
                if (
                    getattr(fn, "__self__", None) is not None
                    and isinstance(fn.__self__, asyncio.Future)
                    and fn.__self__.done()
                ):
                    continue  # the handler was cancelled while waiting for admission
                fn(arg)

        try:
            self._loop.call_soon_threadsafe(apply)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _publish(self) -> None:
        """Fold new latencies into histograms and publish a fresh snapshot."""
        c, st, bm, sched = self._counters, self.llm.stats, self.llm.block_manager, self.llm.scheduler
        screen = self.llm.runner.target.screen
        for name in ("ttft", "tpot", "e2e"):
            values = getattr(st, "e2e_latency" if name == "e2e" else name)
            seen = getattr(c, f"seen_{name}")
            hist: Histogram = getattr(c, name)
            for v in values[seen:]:
                hist.observe(v)
            setattr(c, f"seen_{name}", len(values))
        self.snapshot = MetricsSnapshot(
            model_name=self.model_name,
            cpu_isa=self.cpu_isa,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_usage=bm.usage,
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            num_preemptions=st.num_preemptions,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=st.num_generated_tokens,
            spec_proposed=st.spec_proposed,
            spec_accepted=st.spec_accepted,
            head_screen_rows=screen.calls if screen is not None else 0,
            head_screen_candidates=screen.candidates if screen is not None else 0,
            finished=dict(c.finished),
            rejected=c.rejected,
            ttft=c.ttft.copy(),
            tpot=c.tpot.copy(),
            e2e=c.e2e.copy(),
        )
