"""One clock with a scale factor, injected wherever time is measured or slept.

The emulator runs `time_scale` times faster than the GPU it imitates. Every duration it reports, and every
duration the load client measures against it, is in *emulated* seconds: wall seconds x scale.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    """`scale` emulated seconds pass per wall second (1.0 = real time)."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"time scale must be > 0, got {self.scale}")

    def now(self) -> float:
        """Monotonic emulated seconds."""
        return time.perf_counter() * self.scale

    def to_wall(self, emulated_seconds: float) -> float:
        return emulated_seconds / self.scale

    async def sleep(self, emulated_seconds: float) -> None:
        await asyncio.sleep(max(0.0, emulated_seconds / self.scale))

    def sleep_sync(self, emulated_seconds: float) -> None:
        time.sleep(max(0.0, emulated_seconds / self.scale))


REAL_TIME = Clock(1.0)
