"""Start and stop a server process for a benchmark: its own process group (so every child goes with it), its log in a
file, ready when /health answers 200. Shared by the scripts that start real vLLM or the emulator."""

from __future__ import annotations

import argparse
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tuner.launch.process import stop_group

ROOT = Path(__file__).resolve().parent.parent


def start_server(
    cmd: list[str], port: int, log: Path, env: dict[str, str], timeout_s: float = 900
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode} at start; its log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"not ready within {timeout_s:.0f} s; its log: {log}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc)


def vllm_paths(args: argparse.Namespace) -> tuple[str, str]:
    """The vLLM venv's python and the model directory: the options given, else the tests' variables, else what
    scripts/real-vllm installs (cached)."""
    python = args.vllm_python or os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = args.model_dir or os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not python or not model:
        out = subprocess.run([str(ROOT / "scripts" / "real-vllm")], check=True, capture_output=True, text=True).stdout
        found = dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in out.splitlines())
        python = python or found["TUNER_TEST_VLLM_PYTHON"]
        model = model or found["TUNER_TEST_VLLM_MODEL"]
    return python, model
