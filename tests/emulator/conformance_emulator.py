"""The conformance recording of the emulator: the recorder's own probes (tuner/conformance), put to an in-process
emulator that imitates the recorded server (its model's config.json from the fixture, its served name and
max_model_len), through httpx.ASGITransport; its start-up log and refusals from Emulator.startup."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx

from tuner.conformance.log_lines import failure_shape, startup_lines
from tuner.conformance.metrics_shape import metrics_shape
from tuner.conformance.probes import probe_http
from tuner.conformance.record import MAX_MODEL_LEN, SERVED_NAME
from tuner.emulator import Emulator
from tuner.emulator.config import parse_config

# The refusals the fixtures hold, asked of the emulator in its own terms: the same flag pair for SchedulerConfig;
# for a KV cache too small, the emulator has no --num-gpu-blocks-override and an 8B model on a 24 GiB card at its
# full 131,072-token context is the same check failing (kv_cache_utils.py _check_enough_kv_cache_memory).
FAILURE_ARGS: dict[str, list[str]] = {
    "invalid_flags": ["--max-model-len", "1024", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
    "kv_cache_too_small": ["--model", "llama-3.1-8b", "--gpu", "rtx4090"],
}


def model_dir(fixtures: Path, tmp: Path) -> Path:
    """A directory with the recorded model's config.json: the emulator sizes the same model."""
    server = json.loads((fixtures / "server.json").read_text(encoding="utf-8"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(server["model_config"]), encoding="utf-8")
    return tmp


def emulator_args(model: Path) -> list[str]:
    return ["--model", str(model), "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
            "--time-scale", "1000"]  # fmt: skip


async def record_emulator(model: Path) -> dict[str, dict[str, Any]]:
    emu = Emulator.from_args(emulator_args(model), log_stream=io.StringIO())
    await emu.startup(delays=False)
    async with emu.running():
        transport = httpx.ASGITransport(app=emu.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://emulator", timeout=60) as client:
            http = await probe_http(client, SERVED_NAME, MAX_MODEL_LEN)
            text = (await client.get("/metrics")).text
    failures: dict[str, Any] = {}
    for name, args in FAILURE_ARGS.items():
        argv = args if "--model" in args else ["--model", str(model), *args]
        failed = Emulator(parse_config(argv), log_stream=io.StringIO())
        started = await failed.startup(delays=False)
        log = "\n".join(failed.log.lines)
        failures[name] = {"flags": FAILURE_ARGS_RECORDED[name], **failure_shape(log, None if started else 1)}
    return {
        "http": http,
        "metrics": {"families": metrics_shape(text)},
        "startup": {"lines": startup_lines(emu.log.text()), "failures": failures},
    }


# The flags the fixtures name for each refusal (what real vLLM was started with).
FAILURE_ARGS_RECORDED: dict[str, list[str]] = {
    "invalid_flags": ["--max-model-len", "1024", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
    "kv_cache_too_small": ["--max-model-len", "4096", "--num-gpu-blocks-override", "16"],
}
