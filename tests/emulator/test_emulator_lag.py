"""The emulator's lag: an engine slowed on purpose (a clock that jumps past every step's deadline) counts the
virtual time it lost; one on time counts none; an HTTP front slowed on purpose (its clock reading later than the
engine's, so every answer goes out late) counts its late answers; `/emulator/stats` serves both, and the load phase's
watch marks a run on either lagged and measures it again. No timing bound: fake clocks."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field

import httpx
import pytest

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.clock import Clock
from tuner.emulator import Emulator
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.front_lag import FrontLag
from tuner.emulator.kv_pool import KvBlockPool
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import VllmFlags, resolve
from tuner.load.contention import Contention
from tuner.load.emulator_lag import read_emulator_lag, reset_emulator_prefix_cache
from tuner.study.measure import REMEASURES, Measurement, measure_watched

H100 = get_gpu("h100-80gb")
LLAMA = load_model("llama-3.1-8b")


@pytest.fixture(autouse=True)
def _the_products_lag_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the lag itself: the study's own limit, not the suite's (tests/conftest.py)."""
    monkeypatch.delenv("TUNER_EMULATOR_LAG_LIMIT", raising=False)


@dataclass(frozen=True)
class _SteppingClock(Clock):
    """Each reading `step` emulated seconds after the last: huge, an engine starved of CPU; tiny, one on time."""

    step: float = 0.0
    t: list[float] = field(default_factory=lambda: [0.0])

    def now(self) -> float:
        self.t[0] += self.step
        return self.t[0]


@dataclass(frozen=True)
class _LateClock(Clock):
    """`base` read `late_s` emulated seconds on: a front that gets to every answer that long after it was due."""

    base: Clock = field(default_factory=Clock)
    late_s: float = 0.0

    def now(self) -> float:
        return self.base.now() + self.late_s


class _Sink:
    def __init__(self, done: asyncio.Event) -> None:
        self.done = done

    def on_token(self, index: int, finish_reason: str | None) -> None:
        if finish_reason is not None:
            self.done.set()

    def on_cut(self) -> None:
        self.done.set()


async def _lag_of_one_request(clock: Clock) -> tuple[float, int, float]:
    resolved = resolve(VllmFlags(max_model_len=4096), H100, LLAMA)
    engine = Engine(
        LLAMA,
        resolved,
        plan_startup(LLAMA, H100, resolved),
        StepTimeModel.build(LLAMA, H100, resolved),
        clock,
        EmulatorMetrics(LLAMA.name, resolved.max_model_len, {}),
        VllmLog(io.StringIO()),
        lambda _reason, _lines: None,
        log_stats=False,
    )
    done = asyncio.Event()
    task = asyncio.create_task(engine.run())
    engine.submit(EngineRequest("r", list(range(64)), 4, "length", _Sink(done), resolved.block_size, False))
    await done.wait()
    engine.stop()
    await task
    return engine.stats.lag_s, engine.stats.late_steps, engine.stats.behind_s


async def test_an_engine_slowed_on_purpose_counts_the_time_it_lost() -> None:
    lag, late, behind = await _lag_of_one_request(_SteppingClock(step=100.0))
    assert late >= 4 and lag >= 4 * 99.0 and behind >= lag


async def test_an_engine_on_time_counts_no_lag() -> None:
    lag, late, behind = await _lag_of_one_request(_SteppingClock(step=1e-9))
    assert (lag, late, behind) == (0.0, 0, 0.0)


async def test_the_emulator_serves_its_lag_and_the_load_phase_reads_it() -> None:
    emu = Emulator.from_args(["--model", "llama-3.1-8b", "--gpu", "h100-80gb"], log_stream=io.StringIO())
    # busy stretches that took 1.25 emulated s longer than their modelled steps
    emu.engine.stats.model_busy_s, emu.engine.stats.actual_busy_s = 10.0, 11.25
    async with emu.serve_http(host="127.0.0.1", port=0) as base:
        assert await read_emulator_lag(base) == 1.25
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{base}/emulator/stats")).json()["behind_s"] == 1.25


async def test_a_server_that_is_not_the_emulator_has_no_lag() -> None:
    assert await read_emulator_lag("http://127.0.0.1:9") is None


async def _watched_run(
    clock: Clock, front: Clock | None = None, *, stream: bool = False
) -> tuple[Contention | None, dict[str, float]]:
    """Two requests through the emulator's HTTP API, its engine on `clock` (the front reads it too, unless given a
    clock of its own), under the study's lag watch: the run's contention and the emulator's stats after it."""
    emu = Emulator.from_args(["--model", "llama-3.1-8b", "--gpu", "h100-80gb"], log_stream=io.StringIO())
    emu.engine.clock = clock  # the seam: the engine's clock
    emu.api.front.clock = front  # and the HTTP front's, apart from it
    async with emu.serve_http(host="127.0.0.1", port=0) as base:

        async def run() -> Measurement:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                for i in range(2):
                    body = {"model": "llama-3.1-8b", "prompt": [i, *range(1, 64)], "max_tokens": 4, "stream": stream}
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200 and (not stream or response.text.endswith("[DONE]\n\n"))
            return Measurement(None)

        measured = await measure_watched(run, base, emu.time_scale)
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"{base}/emulator/stats")).json()
    return measured.contention, stats


async def test_an_emulator_slowed_on_purpose_has_its_run_marked_lagged_and_measured_again() -> None:
    c, stats = await _watched_run(_SteppingClock(step=100.0))
    assert c is not None and c.lagged and c.measured_again == REMEASURES
    assert c.emulator_lag_s is not None and c.emulator_lag_s >= 100.0 and stats["engine_behind_s"] >= 100.0


@pytest.mark.parametrize("stream", [False, True])
async def test_an_emulator_on_time_is_measured_once(stream: bool) -> None:
    c, stats = await _watched_run(_SteppingClock(step=1e-9), stream=stream)
    assert c is not None and not c.lagged and c.measured_again == 0
    # the fake clock moves 1e-9 s a reading: an answer is a few readings after its token, inside the allowance
    assert c.emulator_lag_s == 0.0 and stats["late_answers"] == 0 and stats["answered"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_an_http_front_slowed_on_purpose_has_its_run_marked_lagged_and_measured_again(stream: bool) -> None:
    # The engine on time; the front gets to every answer 100 emulated seconds after the engine emitted it (as at an
    # extreme time_scale, where the client would time out): no engine lag, yet the run is lagged, not failed.
    engine = _SteppingClock(step=1e-9)
    c, stats = await _watched_run(engine, _LateClock(base=engine, late_s=100.0), stream=stream)
    assert c is not None and c.lagged and c.measured_again == REMEASURES
    assert c.emulator_lag_s is not None and c.emulator_lag_s >= 99.0
    assert stats["engine_behind_s"] == pytest.approx(0.0, abs=1e-6) and stats["front_behind_s"] >= 99.0
    assert stats["late_answers"] == stats["answered"] == 2 * (REMEASURES + 1)


def test_requests_late_together_lose_the_run_their_lateness_once() -> None:
    # Ten requests open at once, each answered a second late: the run lost one second, not ten (no allowance here).
    t = [0.0]

    @dataclass(frozen=True)
    class Manual(Clock):
        def now(self) -> float:
            return t[0]

    front = FrontLag(lambda: Manual(), allowance_wall_s=0.0)
    opened = [front.opened(0.0) for _ in range(10)]
    t[0] = 10.0
    for o in opened:
        front.closed(o, 1.0)
    assert front.behind_s == pytest.approx(1.0) and front.late_s == pytest.approx(10.0)
    assert front.answered == 10 and front.late_answers == 10 and front.open == 0


def test_a_reset_forgets_the_free_blocks_prefixes_and_keeps_those_in_use() -> None:
    pool = KvBlockPool(8, 16, enable_caching=True)
    done: list[int] = []
    held: list[int] = []
    assert pool.allocate(2, done) and pool.allocate(1, held)
    for block, h in zip([*done, *held], (11, 12, 13), strict=True):
        pool.register(block, h)
    pool.free_blocks(done)
    assert pool.lookup([11, 12], 2) != [] and pool.lookup([13], 1) == held
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup([11, 12], 2) == [] and pool.lookup([13], 1) == held


async def test_the_emulator_resets_its_prefix_cache_on_asking() -> None:
    emu = Emulator.from_args(["--model", "llama-3.1-8b", "--gpu", "h100-80gb"], log_stream=io.StringIO())
    free: list[int] = []
    assert emu.engine.pool.allocate(1, free)
    emu.engine.pool.register(free[0], 7)
    emu.engine.pool.free_blocks(free)
    async with emu.serve_http(host="127.0.0.1", port=0) as base:
        await reset_emulator_prefix_cache(base)
    assert emu.engine.pool.lookup([7], 1) == []
