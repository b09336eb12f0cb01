"""The spread of a real server's step times: each engine step's modelled time times a seeded log-normal factor.

A real server's steps are not all alike (the host's scheduling work, the allocator, other processes on its cores): on
vLLM's CPU build here the TTFT p95/p50 under a closed loop was 1.14-2.48 where an emulator with equal step times read
1.00-1.03 (benchmarks/README.md, "TTFT's spread"). The factor has mean 1 (exp(sigma z - sigma^2 / 2)), so throughput
keeps the step-time model's figure on average and only the spread is added. The default sigma, 0.08, is the least of
that measured spread: a log-normal's p95/p50 is exp(1.645 sigma) = 1.14. The draws come from their own seeded
generator, so one seed gives one sequence of steps, run to run.
"""

from __future__ import annotations

import math
import random

__all__ = ["DEFAULT_STEP_JITTER", "StepJitter"]

DEFAULT_STEP_JITTER = 0.08


class StepJitter:
    """Step-time factors of log-normal spread `sigma` (0: every factor 1.0), drawn in order from `seed`."""

    __slots__ = ("_bias", "_rng", "sigma")

    def __init__(self, sigma: float = DEFAULT_STEP_JITTER, seed: int = 0) -> None:
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"step jitter sigma must be a finite number >= 0, got {sigma}")
        self.sigma = sigma
        self._bias = -sigma * sigma / 2  # E[exp(sigma z)] = exp(sigma^2 / 2): divided out, the mean stays 1
        self._rng = random.Random(seed)

    def factor(self) -> float:
        if self.sigma == 0:
            return 1.0
        return math.exp(self.sigma * self._rng.gauss(0.0, 1.0) + self._bias)
