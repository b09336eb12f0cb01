"""The recorder: start the pinned real vLLM, ask it the conformance questions, write version-stamped fixtures.

    scripts/record-vllm-conformance            # -> tests/emulator/fixtures/vllm-<pin>/ (needs scripts/real-vllm)

One server answers the HTTP probes and gives its start-up log and `/metrics` (after the probes, so that every
family that appears only once requests ran is there); one more for each start-up refusal (FAILURES), with the flags
or the environment vLLM refuses. Every server is stopped (its process group) before the recorder returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tuner.conformance.fixtures import fixture_dir, write_fixture
from tuner.conformance.log_lines import failure_shape, startup_lines
from tuner.conformance.metrics_shape import metrics_shape
from tuner.conformance.probes import probe_http
from tuner.launch.process import stop_group
from tuner.vllm_pin import PINNED_VLLM

SERVED_NAME = "tiny"
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Refusal:
    """A start vLLM refuses: the arguments after the recorder's own, and the environment it changes."""

    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


# The start-up refusals a launcher tells apart (tuner/launch/failures.py), each as the CPU build gives it: a flag pair
# SchedulerConfig rejects; a KV cache (16 CPU blocks of 128 tokens) too small for one request of max_model_len; an
# option vLLM does not have (argparse); a model path that does not exist (a fixed one, so the sentence does not change
# from recording to recording); and no KV memory at all (VLLM_CPU_KVCACHE_SPACE=0: CpuPlatform turns it into
# kv_cache_memory_bytes=0, which _check_enough_kv_cache_memory refuses in vllm/v1/core/kv_cache_utils.py, 0.32.0).
FAILURES: dict[str, Refusal] = {
    "invalid_flags": Refusal(("--max-model-len", "1024", "--max-num-seqs", "64", "--max-num-batched-tokens", "32")),
    "kv_cache_too_small": Refusal(("--max-model-len", "4096", "--num-gpu-blocks-override", "16")),
    "unknown_flag": Refusal(("--no-such-flag", "1")),
    "model_not_found": Refusal(("--model", "/nonexistent/tiny-model")),
    "no_kv_memory": Refusal((), (("VLLM_CPU_KVCACHE_SPACE", "0"),)),
}
READY_LIMIT_S = 900.0  # a bound for a busy 2-core machine, not a measurement


class RecordError(Exception):
    """The recorder cannot go on; the message says why, in one line."""


@dataclass
class Started:
    base_url: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env(changes: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """The CPU KV space (GiB, an integer) the fixtures were recorded with, and a refusal's `changes`; no usage
    reports leave the machine."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        **dict(changes),
    }


@contextmanager
def start_vllm(
    python: Path,
    model_dir: Path,
    port: int,
    extra: Sequence[str],
    workdir: Path,
    env: Sequence[tuple[str, str]] = (),
) -> Iterator[Started]:
    """A real vLLM in its own process group, its output in a file; the group is stopped on exit."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip
    log_path = workdir / f"vllm-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(env), start_new_session=True)
    try:
        yield Started(f"http://127.0.0.1:{port}", log_path, proc)
    finally:
        stop_group(proc, grace_s=60)


def wait_ready(server: Started, limit_s: float = READY_LIMIT_S) -> bool:
    """True once /health answers 200; False if the server exited first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RecordError(f"vLLM at {server.base_url} was not ready within {limit_s:.0f} s")


async def record_http(base_url: str, model: str, max_model_len: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The HTTP answers, then /metrics (scraped after the probes so that request-driven families exist)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as client:
        http = await probe_http(client, model, max_model_len)
        text = (await client.get("/metrics")).text
    return http, {"families": metrics_shape(text)}


def record_server(
    base_url: str, log: str, model: str = SERVED_NAME, max_model_len: int = MAX_MODEL_LEN
) -> dict[str, dict[str, Any]]:
    """Everything one ready server gives: HTTP answers, /metrics, the start-up lines its log has."""
    http, metrics = asyncio.run(record_http(base_url, model, max_model_len))
    return {"http": http, "metrics": metrics, "startup": {"lines": startup_lines(log)}}


def refused_start(python: Path, model_dir: Path, refusal: Refusal, workdir: Path) -> tuple[str, int | None]:
    """Real vLLM started with what it should refuse: its whole log and its exit code. Eager: the refusals that come
    after the model's warm-up (the KV cache's) are the same without its torch.compile pass, which the CPU build
    redoes at every start (its compiled-function cache fails to load) and which is most of a start here."""
    extra = ("--enforce-eager", *refusal.flags)
    with start_vllm(python, model_dir, _free_port(), extra, workdir, refusal.env) as server:
        if wait_ready(server):
            given = " ".join([*(f"{k}={v}" for k, v in refusal.env), *refusal.flags])
            raise RecordError(f"vLLM started with {given}, which it should refuse")
        return server.log(), server.proc.returncode


def failure_record(refusal: Refusal, log: str, exit_code: int | None) -> dict[str, Any]:
    """The fixture's entry for a refused start: what was given and the failure's shape."""
    env = {"env": dict(refusal.env)} if refusal.env else {}
    return {"flags": list(refusal.flags), **env, **failure_shape(log, exit_code)}


def record_failure(python: Path, model_dir: Path, refusal: Refusal, workdir: Path) -> dict[str, Any]:
    return failure_record(refusal, *refused_start(python, model_dir, refusal, workdir))


def record_all(python: Path, model_dir: Path, out: Path, *, port: int | None = None) -> list[Path]:
    """Record every fixture into `out` (a version directory); the files written."""
    with tempfile.TemporaryDirectory(prefix="vllm-conformance-") as tmp:
        workdir = Path(tmp)
        extra = ("--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN))
        with start_vllm(python, model_dir, port or _free_port(), extra, workdir) as server:
            if not wait_ready(server):
                raise RecordError(f"vLLM exited with {server.proc.returncode} at start:\n{server.log()[-2000:]}")
            version = httpx.get(f"{server.base_url}/version", timeout=10).json()["version"]
            if version != PINNED_VLLM:
                raise RecordError(f"the server is vLLM {version}, the pin (tuner/vllm_pin.py) is {PINNED_VLLM}")
            parts = record_server(server.base_url, server.log())
        parts["startup"]["failures"] = {
            name: record_failure(python, model_dir, refusal, workdir) for name, refusal in FAILURES.items()
        }
    parts["server"] = {
        "recorded": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": "python -m vllm.entrypoints.openai.api_server --model DIR " + " ".join(extra),
        "env": {"VLLM_CPU_KVCACHE_SPACE": vllm_env()["VLLM_CPU_KVCACHE_SPACE"]},
        "model_config": json.loads((model_dir / "config.json").read_text(encoding="utf-8")),
    }
    return [write_fixture(out, name, version, parts[name]) for name in ("server", "http", "metrics", "startup")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/record-vllm-conformance",
        description="Record the conformance fixtures (HTTP, /metrics, start-up lines and refusals) from the pinned "
        'real vLLM. Reads TUNER_TEST_VLLM_PYTHON and TUNER_TEST_VLLM_MODEL (eval "$(scripts/real-vllm)").',
        epilog='example:\n  eval "$(scripts/real-vllm)" && scripts/record-vllm-conformance',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("tests/emulator/fixtures"), help="fixtures root")
    parser.add_argument("--port", type=int, default=None, help="port of the probed server (default: a free one)")
    args = parser.parse_args(argv)
    python = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not python or not model:
        print("record-vllm-conformance: TUNER_TEST_VLLM_PYTHON and TUNER_TEST_VLLM_MODEL must be set "
              "(eval \"$(scripts/real-vllm)\")", file=sys.stderr)  # fmt: skip
        return 2
    try:
        paths = record_all(Path(python), Path(model), fixture_dir(args.out), port=args.port)
    except RecordError as e:
        print(f"record-vllm-conformance: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
