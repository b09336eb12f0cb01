"""A CPU-only vLLM look-alike: vLLM's flags, start-up arithmetic and failures, V1 scheduler over a paged KV
cache, a calibrated step-time model, and the OpenAI-compatible HTTP + /metrics surface."""

from tuner.emulator.config import EmulatorConfig, build_parser, parse_config
from tuner.emulator.emulator import Emulator, EmulatorStartupError, main
from tuner.emulator.engine import Engine, EngineStats
from tuner.emulator.simulate import SimulationResult, simulate_closed_loop
from tuner.emulator.step_time import StepTimeModel

__all__ = [
    "Emulator",
    "EmulatorConfig",
    "EmulatorStartupError",
    "Engine",
    "EngineStats",
    "SimulationResult",
    "StepTimeModel",
    "build_parser",
    "main",
    "parse_config",
    "simulate_closed_loop",
]
