"""Schedules the requests of one load run (closed or open loop), measures them, and scores the result."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx

from tuner.clock import REAL_TIME, Clock
from tuner.load.arrival import Arrival, send_offsets
from tuner.load.client import send_request
from tuner.load.connections import load_transport
from tuner.load.conversation import Conversation, turn_figures
from tuner.load.prompt_fit import PromptFit, fit_prompts
from tuner.load.results import LoadResult, RequestRecord
from tuner.load.server_metrics import MetricsScraper, diagnose
from tuner.load.server_metrics import scrape_metrics as _scrape
from tuner.load.slo_guard import SloGuard
from tuner.load.trace_replay import trace_prompts
from tuner.load.workload import PromptSpec, Workload
from tuner.scoring import Slo, summarize

__all__ = ["LoadProgress", "new_client", "run_load"]

_UNREACHABLE_AFTER = 20
"""Consecutive refused connections, with no success yet, after which the target counts as unreachable."""
_RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class LoadProgress:
    sent: int
    done: int
    failed: int
    in_flight: int
    elapsed_s: float
    rate: float
    """Completed requests per second over the last few (emulated) seconds."""
    warmup: bool


def new_client() -> httpx.AsyncClient:
    """A client with no connection cap (the arrival schedule, not a pool, decides how many are in flight) over
    aiohttp's connections (see tuner.load.connections for why)."""
    return httpx.AsyncClient(transport=load_transport(), trust_env=False)


@dataclass(frozen=True)
class _Job:
    index: int
    warmup: bool
    spec: PromptSpec


def _anchor(clock: Clock) -> tuple[float, float]:
    """The run's origin on `clock` and the wall-clock time of the same instant: the records' times in the wall clock.

    Read between two wall-clock reads, again if the thread was preempted in between (a busy machine's slice is
    milliseconds), so the pair is within 0.1 ms of each other, not within however long the preemption lasted.
    """
    for _ in range(10):
        before = time.time()
        origin = clock.now()
        after = time.time()
        if after - before < 1e-4:
            break
    return origin, (before + after) / 2


def _prompts(workload: Workload, arrival: Arrival, fit: PromptFit | None) -> Iterator[PromptSpec]:
    """The workload's endless prompts, or a trace's: its slice's lengths, its shared blocks as shared text."""
    if arrival.trace is None:
        return workload.prompts(fit)
    # the arrival's seed too: a rate search's steps replay the slice with blocks of their own
    seed = workload.seed + arrival.seed
    return trace_prompts(arrival.trace_requests(), fit, api=workload.api, block_tokens=arrival.block_tokens, seed=seed)


class _Run:
    """Shared state of one run: which request comes next, when to stop, what has come back."""

    def __init__(
        self,
        workload: Workload,
        arrival: Arrival,
        clock: Clock,
        should_stop: Callable[[], bool] | None,
        on_progress: Callable[[LoadProgress], None] | None,
        guard: SloGuard | None = None,
        fit: PromptFit | None = None,
    ) -> None:
        self.workload = workload
        self.arrival = arrival
        self.clock = clock
        self.should_stop = should_stop
        self.on_progress = on_progress
        self.fit = fit
        self.prompts: Iterator[PromptSpec] = _prompts(workload, arrival, fit)
        self.origin, self.origin_unix = _anchor(clock)
        self.measured_start: float | None = None
        self.issued = 0
        self.measured_issued = 0
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.failed = 0
        self.stopping = False
        self.ended = asyncio.Event()  # set with `stopping`: wakes the users who are thinking
        self.stopped_early = False
        self.refused_streak = 0
        self.succeeded = 0
        self.completions: deque[float] = deque()
        self.guard = guard
        self.slo_stop: str | None = None

    def next_job(self, spec: PromptSpec | None = None) -> _Job | None:
        """The next request, `spec` or else the workload's (or trace's) next prompt; None once the run is over."""
        if self.stopping:
            return None
        if self.should_stop is not None and self.should_stop():
            self.stop(early=True)
            return None
        now = self.clock.now()
        a = self.arrival
        warmup = self.issued < a.warmup_requests or now - self.origin < a.warmup_s
        if not warmup:
            if self.measured_start is None:
                self.measured_start = now
            if a.requests is not None and self.measured_issued >= a.requests:
                self.stop(early=False)
                return None
            # a trace's duration is its slice's, already cut
            if a.duration_s is not None and a.trace is None and now - self.measured_start >= a.duration_s:
                self.stop(early=False)
                return None
        spec = spec if spec is not None else next(self.prompts, None)
        if spec is None:  # a trace's slice is all sent
            self.stop(early=False)
            return None
        if not warmup:
            self.measured_issued += 1
        job = _Job(index=self.issued, warmup=warmup, spec=spec)
        self.issued += 1
        return job

    def stop(self, *, early: bool) -> None:
        self.stopping = True
        self.ended.set()
        self.stopped_early = self.stopped_early or early

    async def execute(
        self,
        client: httpx.AsyncClient,
        url: str,
        model: str,
        timeout_s: float,
        job: _Job,
        reply: list[str] | None = None,
    ) -> RequestRecord:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            record = await send_request(
                client,
                url,
                self.workload.body(model, job.spec),
                clock=self.clock,
                timeout_s=timeout_s,
                index=job.index,
                origin=self.origin,
                warmup=job.warmup,
                chat=self.workload.is_chat,
                expect_output=job.spec.output_len,
                reply=reply,
            )
        finally:
            self.in_flight -= 1
        record.turn = job.spec.turn
        self._account(record)
        return record

    async def pause(self, seconds: float) -> None:
        """Sleep on the run's clock, cut short when the run ends (a user thinking then has nothing left to send):
        at once when every request is sent, at the measured phase's end for a duration."""
        a = self.arrival
        if self.measured_start is not None:
            if a.requests is not None and self.measured_issued >= a.requests:
                self.stop(early=False)
                return
            if a.duration_s is not None:
                seconds = min(seconds, max(0.0, self.measured_start + a.duration_s - self.clock.now()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ended.wait(), self.clock.to_wall(seconds))

    def _account(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.guard is not None and self.slo_stop is None and (reason := self.guard.add(record)) is not None:
            self.slo_stop = reason
            self.stop(early=True)
        now = self.clock.now()
        self.completions.append(now)
        while self.completions and now - self.completions[0] > _RATE_WINDOW_S:
            self.completions.popleft()
        if record.ok:
            self.succeeded += 1
            self.refused_streak = 0
        else:
            self.failed += 1
            if record.error_class == "connection_refused":
                self.refused_streak += 1
                if self.succeeded == 0 and self.refused_streak >= _UNREACHABLE_AFTER:
                    self.stop(early=True)
        if self.on_progress is not None:
            elapsed = now - self.origin
            window = min(_RATE_WINDOW_S, elapsed) if elapsed > 0 else 0.0
            self.on_progress(
                LoadProgress(
                    sent=self.issued,
                    done=len(self.records),
                    failed=self.failed,
                    in_flight=self.in_flight,
                    elapsed_s=elapsed,
                    rate=len(self.completions) / window if window > 0 else 0.0,
                    warmup=self.measured_start is None,
                )
            )


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    arrival: Arrival,
    *,
    slos: Sequence[Slo] = (),
    client: httpx.AsyncClient | None = None,
    clock: Clock = REAL_TIME,
    request_timeout_s: float = 60.0,
    scrape_metrics: bool = True,
    on_progress: Callable[[LoadProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    max_num_seqs: int | None = None,
    stop_on_slo_miss: bool = False,
    prompt_fit: PromptFit | None = None,
    judge: Sequence[Slo] | None = None,
) -> LoadResult:
    """Run one load phase against `base_url` (the server root, no /v1) and score it.

    Times are in the clock's seconds (emulated seconds against an emulator: pass Clock(time_scale)), and so is
    `request_timeout_s`. Server misbehaviour never raises: it shows as failed records. `should_stop` is polled
    and, once true, stops sending and abandons the requests in flight (they are left out of the records).
    `stop_on_slo_miss` does the same once an SLO is missed for certain (see tuner.load.slo_guard; only with a
    request count), and says why in the result's `slo_stop`; it watches `judge` where given (the goodput search's
    `good_share` bound), `slos` otherwise; `slos` are what the summary's goodput counts each request against.
    Synthetic prompts are written to the server's tokenizer (`prompt_fit`, asked of the server first when not
    given: see tuner.load.prompt_fit).
    """
    if workload.conversations is not None and not arrival.closed:
        raise ValueError("conversations run on a closed loop (arrival.concurrency): each user holds a conversation")
    own = client is None
    http = new_client() if client is None else client
    scraper: MetricsScraper | None = None
    try:
        fit = prompt_fit
        # A dataset's text goes as it is; only made-up tokens (prompts, or a dataset's shared prefix) need a fit.
        if fit is None and (workload.dataset is None or workload.prefix_len > 0):
            fit = await fit_prompts(http, base_url, model)
        count = _measured_count(arrival)
        watched = slos if judge is None else judge
        guard = SloGuard(watched, count, bounds=slos) if stop_on_slo_miss and count else None
        run = _Run(workload, arrival, clock, should_stop, on_progress, guard if guard and guard.active else None, fit)
        url = base_url.rstrip("/") + workload.path
        async with contextlib.AsyncExitStack() as stack:
            if scrape_metrics:
                scraper = await stack.enter_async_context(_scrape(http, base_url, clock=clock, model=model))
            await _drive(run, http, url, model, request_timeout_s)
    finally:
        if own:
            await http.aclose()
    return _result(run, slos, scraper, max_num_seqs)


def _measured_count(arrival: Arrival) -> int | None:
    """The measured requests a run will send when known before it runs: its count, or a trace slice's."""
    if arrival.trace is not None:
        return max(0, len(arrival.trace_requests()) - arrival.warmup_requests)
    return arrival.requests


async def _drive(run: _Run, client: httpx.AsyncClient, url: str, model: str, timeout_s: float) -> None:
    tasks: set[asyncio.Task[RequestRecord]] = set()

    async def watch() -> None:
        while True:
            await asyncio.sleep(0.05)
            if run.should_stop is not None and not run.stopping and run.should_stop():
                run.stop(early=True)
            if run.stopped_early:
                for t in list(tasks):
                    t.cancel()
                return

    def spawn(job: _Job, reply: list[str] | None = None) -> asyncio.Task[RequestRecord]:
        task = asyncio.create_task(run.execute(client, url, model, timeout_s, job, reply))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    watcher = asyncio.create_task(watch())
    try:
        if run.workload.conversations is not None:
            assert run.arrival.concurrency is not None
            await _conversation_users(run, run.arrival.concurrency, spawn)
        elif run.arrival.concurrency is not None:
            await _closed_loop(run, run.arrival.concurrency, spawn)
        else:
            await _open_loop(run, spawn)
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    finally:
        watcher.cancel()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(watcher, *list(tasks), return_exceptions=True)


Spawn = Callable[[_Job, list[str] | None], "asyncio.Task[RequestRecord]"]


async def _closed_loop(run: _Run, users: int, spawn: Spawn) -> None:
    async def user() -> None:
        # Each user sends its next request when its last one ends: exactly `users` in flight, never a batch.
        while (job := run.next_job()) is not None:
            # wait(), not await: an abandoned request must end this user, not raise into it.
            await asyncio.wait({spawn(job, None)})
            if run.stopped_early:
                return

    await asyncio.gather(*(user() for _ in range(users)))


async def _conversation_users(run: _Run, users: int, spawn: Spawn) -> None:
    conversations = run.workload.conversation_source(run.fit)

    async def user() -> None:
        # A user holds its conversation to the end (or to a failed turn), then starts the next one.
        while not run.stopping and await _converse(run, next(conversations), spawn):
            pass

    await asyncio.gather(*(user() for _ in range(users)))


async def _converse(run: _Run, conversation: Conversation, spawn: Spawn) -> bool:
    """One conversation, turn after turn: each sent once the previous answer is in and the think time has passed,
    with every earlier message and answer. False when the run ended during it."""
    history: list[dict[str, str]] = []
    if conversation.system:
        history.append({"role": "system", "content": conversation.system})
    for i, turn in enumerate(conversation.turns):
        if i:
            await run.pause(turn.think_s)
        messages = (*history, {"role": "user", "content": turn.message})
        job = run.next_job(PromptSpec(turn.message, 0, turn.output_len, messages=messages, turn=i))
        if job is None:
            return False
        reply: list[str] = []
        task = spawn(job, reply)
        await asyncio.wait({task})  # wait(), not await: an abandoned request ends the run, it does not raise here
        if run.stopped_early:
            return False
        if task.cancelled() or task.exception() is not None or not task.result().ok:
            return True  # a failed turn has no answer to carry on from: the user starts afresh
        history = [*messages, {"role": "assistant", "content": "".join(reply)}]
    return True


async def _open_loop(run: _Run, spawn: Spawn) -> None:
    cap = run.arrival.max_in_flight
    slots = asyncio.Semaphore(cap) if cap is not None else None
    offsets = send_offsets(run.arrival)
    start = run.clock.now()
    while not run.stopping:
        due = start + next(offsets)
        if due == float("inf"):  # a trace's slice is all sent
            break
        # Sleep to absolute due times, so a late wake-up does not shift every later arrival.
        await run.clock.sleep(due - run.clock.now())
        if slots is not None:
            await slots.acquire()
        job = run.next_job()
        if job is None:
            if slots is not None:
                slots.release()
            break
        task = spawn(job, None)
        if slots is not None:
            task.add_done_callback(_releaser(slots))


def _releaser(slots: asyncio.Semaphore) -> Callable[[asyncio.Task[RequestRecord]], None]:
    return lambda _task: slots.release()


def _result(run: _Run, slos: Sequence[Slo], scraper: MetricsScraper | None, max_num_seqs: int | None) -> LoadResult:
    records = sorted(run.records, key=lambda r: r.index)
    measured = [r for r in records if not r.warmup]
    if measured:
        start = min(r.start_s for r in measured)
        duration = max(r.end_s for r in measured) - start
    else:
        duration = 0.0
    summary = summarize(records, duration_s=duration, slos=slos)
    starts = sorted(r.start_s for r in measured)
    send_rate = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 and starts[-1] > starts[0] else None
    server = scraper.summary() if scraper is not None else None
    return LoadResult(
        summary=summary,
        records=records,
        server=server,
        diagnosis=diagnose(summary, server, run.arrival, max_num_seqs=max_num_seqs, send_rate=send_rate),
        mode=run.arrival.describe(),
        stopped_early=run.stopped_early,
        slo_stop=run.slo_stop,
        workload_fingerprint=run.workload.fingerprint(),
        turns=turn_figures(measured),
        peak_in_flight=run.peak_in_flight,
        origin_unix_s=run.origin_unix,
    )
