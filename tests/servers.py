"""Starting a server process in a test: a free port, and waiting until its `/health` answers.

The wait is a readiness bound for a busy machine, not an assertion on speed: it gives up only when the process has
exited or the limit has passed, and says which, so each caller decides whether that is a skip or a failure.
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A port nothing listens on (bound then released): a server may take it, and until one does connections to it
    are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], limit_s: float) -> str | None:
    """None once `base_url/health` answers 200; otherwise why it never will (the process exited, `limit_s` passed)."""
    deadline = time.monotonic() + limit_s
    while True:
        if proc.poll() is not None:
            return f"the server exited with {proc.returncode} before it was ready"
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return f"not ready within {limit_s:.0f} s"
        time.sleep(0.25)
