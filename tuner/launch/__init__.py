"""Launchers: start a vLLM(-compatible) server with a flag set, know why it failed, leave nothing behind.

launcher = EmulatorLauncher(model="llama-3.1-8b", gpu="h100-80gb", time_scale=50)
async with launcher.start(VllmFlags(max_model_len=8192), study="s", trial=3) as server:
    ...  # server.base_url, server.facts.kv_tokens, server.failure()
"""

from tuner.launch.base import Launcher, Server, StartupFacts
from tuner.launch.docker import DEFAULT_IMAGE, DockerLauncher
from tuner.launch.emulator import EmulatorLauncher, emulator_args
from tuner.launch.failures import REASONS, Diagnosis, find_cause
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.process import ProcessLauncher
from tuner.launch.startup_log import parse_startup_facts

__all__ = [
    "DEFAULT_IMAGE",
    "REASONS",
    "Diagnosis",
    "DockerLauncher",
    "EmulatorLauncher",
    "GpuIdleWaiter",
    "Launcher",
    "ProcessLauncher",
    "Server",
    "StartupFacts",
    "emulator_args",
    "find_cause",
    "parse_startup_facts",
]
