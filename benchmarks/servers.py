"""Start and stop a server process for a benchmark: its own process group (so every child goes with it), its log in a
file, ready when /health answers 200. Shared by the scripts that start real vLLM or the emulator."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


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
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
