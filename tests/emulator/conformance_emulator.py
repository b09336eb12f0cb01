"""The conformance recording of the emulator: the recorder's own probes (tuner/conformance), put to an in-process
emulator that imitates the recorded server (vLLM's CPU build, `--device cpu` with the recording's
VLLM_CPU_KVCACHE_SPACE; its model's config.json from the fixture, its served name and max_model_len), through
httpx.ASGITransport; its start-up log from Emulator.startup, and each refusal asked with the flags and environment
real vLLM was refused with."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tuner.conformance.fixtures import read_fixture
from tuner.conformance.log_lines import failure_shape, startup_lines
from tuner.conformance.metrics_shape import metrics_shape
from tuner.conformance.probes import probe_http
from tuner.conformance.record import MAX_MODEL_LEN, SERVED_NAME
from tuner.emulator import Emulator
from tuner.emulator.config import VllmRefusal, parse_config
from tuner.errors import ConfigError

# The program name argparse gives the recorded entry point (python -m vllm.entrypoints.openai.api_server): a refusal
# of the command line is printed after it, as the emulator prints its own after `tuner emulate`.
RECORDED_PROG = "api_server.py"


def model_dir(fixtures: Path, tmp: Path) -> Path:
    """A directory with the recorded model's config.json: the emulator sizes the same model."""
    server = json.loads((fixtures / "server.json").read_text(encoding="utf-8"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(server["model_config"]), encoding="utf-8")
    return tmp


def emulator_args(model: Path) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--served-model-name", SERVED_NAME,
            "--max-model-len", str(MAX_MODEL_LEN), "--time-scale", "1000"]  # fmt: skip


async def _refusal(model: Path, flags: list[str]) -> dict[str, Any]:
    """A start the recording holds as refused, asked of the emulator: its log and exit code as the process form
    gives them (a command-line refusal is one line and exit 1 or 2, a start-up one the engine's lines and exit 1)."""
    argv = ["--model", str(model), "--device", "cpu", *flags]
    try:
        config = parse_config(argv)
    except ConfigError as e:
        return failure_shape(f"{RECORDED_PROG}: error: {e}", 1 if isinstance(e, VllmRefusal) else 2)
    failed = Emulator(config, log_stream=io.StringIO())
    started = await failed.startup(delays=False)
    return failure_shape("\n".join(failed.log.lines), None if started else 1)


async def record_emulator(fixtures: Path, model: Path) -> dict[str, dict[str, Any]]:
    env = read_fixture(fixtures, "server")["env"]
    recorded = read_fixture(fixtures, "startup")["failures"]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        emu = Emulator.from_args(emulator_args(model), log_stream=io.StringIO())
        await emu.startup(delays=False)
        async with emu.running():
            transport = httpx.ASGITransport(app=emu.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://emulator", timeout=60) as client:
                http = await probe_http(client, SERVED_NAME, MAX_MODEL_LEN)
                text = (await client.get("/metrics")).text
        failures: dict[str, Any] = {}
        for name, asked in recorded.items():
            with pytest.MonkeyPatch.context() as refused:
                for var, value in asked.get("env", {}).items():
                    refused.setenv(var, value)
                shape = await _refusal(model, asked["flags"])
            failures[name] = {"flags": asked["flags"], **({"env": asked["env"]} if "env" in asked else {}), **shape}
    return {
        "http": http,
        "metrics": {"families": metrics_shape(text)},
        "startup": {"lines": startup_lines(emu.log.text()), "failures": failures},
    }
