"""The engine behind a front end that takes time: a request reaches the scheduler `request_latency_s` (emulated)
after the HTTP handler hands it over, as in vLLM, where the API server process parses and tokenises it and passes
it to the engine-core process over ZMQ before the scheduler sees it. A fitted device profile measures that delay
(tuner.calibration); without one it is 0 and this is the metered engine (tuner.emulator.metered) alone. The delay
spreads as the steps do (the engine's jitter): the front end's work per request varies too, so requests sent
together can reach the scheduler in different steps, as real clients drift apart."""

from __future__ import annotations

import asyncio
from typing import Any

from tuner.emulator.engine import WAITING, EngineRequest
from tuner.emulator.metered import MeteredEngine

__all__ = ["FrontendEngine"]


class FrontendEngine(MeteredEngine):
    def __init__(self, *args: Any, request_latency_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request_latency_s = request_latency_s

    def submit(self, req: EngineRequest) -> None:
        if self.request_latency_s <= 0:
            super().submit(req)
            return
        spread = self.jitter.factor() if self.jitter is not None else 1.0
        delay = self.request_latency_s * spread / self.clock.scale
        asyncio.get_running_loop().call_later(delay, self._arrive, req)

    def _arrive(self, req: EngineRequest) -> None:
        # a client that went away meanwhile was aborted: it never reaches the scheduler
        if req.state == WAITING and not self._stopped:
            super().submit(req)
