"""Asynchronous scheduling, vLLM 0.32's default on a GPU and never on its CPU build: the step period (the host's
work hidden under the forward, or added to it) and the scheduler running one step ahead, in virtual time."""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field

import pytest

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.clock import Clock
from tuner.emulator import parse_config
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.logs import VllmLog
from tuner.emulator.metered import MeteredEngine
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.simulate import simulate_closed_loop
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import VllmFlags, resolve
from tuner.step_profile import StepCoefficients

LLAMA = load_model("llama-3.1-8b")
H100 = get_gpu("h100-80gb")
CPU = get_gpu("cpu")


def _step_model(on: bool) -> StepTimeModel:
    return StepTimeModel.build(LLAMA, H100, resolve(VllmFlags(max_model_len=8192, async_scheduling=on), H100, LLAMA))


def test_on_for_a_gpu_server_unless_turned_off_and_never_on_the_cpu_build() -> None:
    assert resolve(VllmFlags(), H100, LLAMA).async_scheduling
    assert not resolve(VllmFlags(async_scheduling=False), H100, LLAMA).async_scheduling
    # CpuPlatform.check_and_update_config sets it off after the flag was read
    assert not resolve(VllmFlags(async_scheduling=True), CPU, LLAMA).async_scheduling
    assert VllmFlags(async_scheduling=False).to_args() == ["--no-async-scheduling"]
    assert VllmFlags(async_scheduling=True).to_args() == ["--async-scheduling"]
    assert VllmFlags.from_dict({"async_scheduling": False}) == VllmFlags(async_scheduling=False)
    assert parse_config(["--model", "llama-3.1-8b", "--no-async-scheduling"]).flags.async_scheduling is False
    assert parse_config(["--model", "llama-3.1-8b"]).flags.async_scheduling is None


@pytest.mark.parametrize("batch", [1, 16, 64, 256])
def test_the_host_work_hides_under_the_forward_when_asynchronous_and_adds_to_it_when_not(batch: int) -> None:
    on, off = _step_model(True), _step_model(False)
    context = batch * 641
    forward = on.forward_seconds(batch, batch, context, context)
    host = on.host_s + on.host_per_request_s * batch
    assert 0 < host < forward
    assert on.decode_step_seconds(batch, 640) == forward
    assert off.decode_step_seconds(batch, 640) == pytest.approx(forward + host)


def test_a_host_slower_than_the_forward_sets_the_period() -> None:
    on = dataclasses.replace(_step_model(True), host_s=1.0)  # a second of scheduling: more than any forward here
    off = dataclasses.replace(on, overlap_host=False)
    forward = on.forward_seconds(4, 4, 4 * 641, 4 * 641)
    host = 1.0 + 4 * on.host_per_request_s
    assert on.decode_step_seconds(4, 640) == host
    assert off.decode_step_seconds(4, 640) == pytest.approx(host + forward)


def test_a_fitted_profile_is_the_period_it_was_measured_as_in_either_mode() -> None:
    c = StepCoefficients(step_overhead_s=2e-3, prefill_token_s=1e-5, decode_seq_s=3e-4, context_token_s=1e-7)
    on, off = _step_model(True).with_coefficients(c), _step_model(False).with_coefficients(c)
    period = 2e-3 + 500 * 1e-5 + 8 * 3e-4 + 1308 * 1e-7
    assert on.step_seconds(508, 8, 1308, 0, 9) == off.step_seconds(508, 8, 1308, 0, 9) == pytest.approx(period)


# -- the scheduler one step ahead ----------------------------------------------------------------------------------


@dataclass
class _Sink:
    tokens: list[tuple[int, str | None]] = field(default_factory=list)

    def on_token(self, index: int, finish_reason: str | None) -> None:
        assert index == len(self.tokens), "every token once, in order"
        self.tokens.append((index, finish_reason))

    def on_cut(self) -> None:
        raise AssertionError("no stream is cut here")


@dataclass(frozen=True)
class _Virtual(Clock):
    at: list[float] = field(default_factory=lambda: [0.0])

    def now(self) -> float:
        return self.at[0]


class _Run:
    """An engine stepped by hand: each step's request ids, one virtual second a step."""

    def __init__(self, on: bool, engine: type[Engine] = Engine, **flags: int) -> None:
        resolved = resolve(VllmFlags(max_model_len=2048, async_scheduling=on, **flags), H100, LLAMA)  # type: ignore[arg-type]
        self.clock = _Virtual()
        self.metrics = EmulatorMetrics("m", 2048, {})
        self.engine = engine(
            LLAMA,
            resolved,
            plan_startup(LLAMA, H100, resolved),
            StepTimeModel.build(LLAMA, H100, resolved),
            self.clock,
            self.metrics,
            VllmLog(io.StringIO()),
            lambda _reason, _lines: None,
            log_stats=False,
        )
        self.steps: list[list[str]] = []
        self.sinks: dict[str, _Sink] = {}

    def submit(self, rid: str, prompt_len: int, output: int, reason: str = "length") -> None:
        ids = [10_000 * len(self.sinks) + i for i in range(prompt_len)]  # no two prompts share a block
        sink = self.sinks[rid] = _Sink()
        self.engine.submit(EngineRequest(rid, ids, output, reason, sink, 16, True))

    def step(self, arriving: tuple[str, int, int] | None = None) -> list[str]:
        """One step; `arriving` (id, prompt, output) reaches the scheduler while it runs."""
        batch = self.engine.begin_step()
        if arriving is not None:
            self.submit(*arriving)
        self.clock.at[0] += 1.0
        self.engine.complete(batch.items, self.clock.at[0])
        self.steps.append([r.request_id for r, _ in batch.items])
        return self.steps[-1]

    def first_step_of(self, rid: str) -> int:
        return next(i for i, ids in enumerate(self.steps) if rid in ids)


@pytest.mark.parametrize(("on", "lag"), [(False, 0), (True, 1)])
def test_a_request_arriving_while_a_step_runs_is_scheduled_one_step_later_when_asynchronous(on: bool, lag: int) -> None:
    run = _Run(on)
    run.submit("a", 64, 8)
    run.step(arriving=("b", 64, 8))
    while len(run.sinks["b"].tokens) < 8:
        run.step()
    assert run.first_step_of("b") == 1 + lag
    assert [len(s.tokens) for s in run.sinks.values()] == [8, 8]


@pytest.mark.parametrize(("on", "wasted"), [(False, False), (True, True)])
def test_an_eos_stop_costs_one_wasted_decode_when_asynchronous_and_a_known_last_token_none(
    on: bool, wasted: bool
) -> None:
    for reason, expect_extra in (("stop", wasted), ("length", False)):
        run = _Run(on)
        run.submit("a", 32, 3, reason)
        run.submit("other", 32, 10)  # keeps the step after a's last one busy
        while not run.sinks["a"].tokens or run.sinks["a"].tokens[-1][1] is None:
            run.step()
        last = len(run.steps) - 1  # a's last token came out of this step
        run.step()
        assert ("a" in run.steps[last + 1]) == expect_extra, reason
        assert run.sinks["a"].tokens[-1] == (2, reason)


def test_a_request_whose_wasted_decode_shares_a_step_with_another_finish_is_counted_once() -> None:
    run = _Run(True, MeteredEngine)
    run.submit("eos", 32, 3, "stop")  # its last token known only once sampled: one decode more is scheduled
    run.submit("four", 32, 4)  # finishes in the step that holds eos's wasted decode
    run.submit("busy", 32, 10)
    while len(run.sinks["busy"].tokens) < 10:
        run.step()
    assert "eos" in run.steps[3] and run.sinks["four"].tokens[-1] == (3, "length")
    done = run.metrics.registry.get_sample_value(
        "vllm:request_prefill_time_seconds_count", {"model_name": "m", "engine": "0"}
    )
    assert done == 3


@pytest.mark.parametrize(("on", "lag"), [(False, 0), (True, 1)])
def test_a_finished_requests_seat_is_free_one_step_later_when_asynchronous(on: bool, lag: int) -> None:
    run = _Run(on, max_num_seqs=2)
    run.submit("short", 32, 2)
    run.submit("long", 32, 12)
    run.submit("queued", 32, 2)  # waits for a seat
    while len(run.sinks["queued"].tokens) < 2:
        run.step()
    last_short = max(i for i, ids in enumerate(run.steps) if "short" in ids)  # its last token's step
    assert run.first_step_of("queued") == last_short + 1 + lag


def test_every_request_gets_each_of_its_tokens_once_through_preemptions_when_asynchronous() -> None:
    # ~3k tokens of KV for 16 requests that need 16 x 700 at their end: preempted and recomputed, tokens in flight
    flags = VllmFlags(max_model_len=2048, gpu_memory_utilization=0.74, max_num_batched_tokens=2048)
    gpu = get_gpu("rtx4090")
    assert resolve(flags, gpu, LLAMA).async_scheduling
    on = simulate_closed_loop(LLAMA, gpu, flags, concurrency=16, input_len=500, output_len=200, requests=32)
    off = simulate_closed_loop(
        LLAMA, gpu, flags.model_copy(update={"async_scheduling": False}), concurrency=16, input_len=500,
        output_len=200, requests=32,
    )  # fmt: skip
    assert on.preemptions > 0 and off.preemptions > 0
    assert on.requests == off.requests == 32
    assert on.output_tok_s * on.duration_s == pytest.approx(32 * 200) == off.output_tok_s * off.duration_s
