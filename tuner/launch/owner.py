"""Who started a server: this host, this tuner process, and its start time (a pid alone can be reused).

Every container and process record carries the owner token, so `cleanup_leftovers` removes only what a dead run
left behind and never a sibling worker's live server of the same study.
"""

from __future__ import annotations

import os
import socket


def process_start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if not readable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after the last ")".
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{process_start_ticks(pid) or '?'}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(token: str) -> bool | None:
    """True if the owner still runs, False if it is gone, None if it ran on another host (cannot tell)."""
    host, _, rest = token.partition(":")
    pid_text, _, ticks = rest.partition(":")
    if host != socket.gethostname():
        return None
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if not pid_alive(pid):
        return False
    return ticks in ("?", "") or process_start_ticks(pid) == ticks
