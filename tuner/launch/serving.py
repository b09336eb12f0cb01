"""From a started process or container to a ready `Server`, or the classified reason it never became one.

Shared by every launcher, so a start fails with the same reasons and texts whatever runs the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tuner.errors import LaunchError
from tuner.launch.base import Server, ServerHandle
from tuner.launch.failures import classify_startup_exit, refusal_in, start_timeout_error
from tuner.launch.readiness import ServerExited, StartTimedOut, wait_until_ready
from tuner.launch.redact import Redactor, redact_error
from tuner.launch.startup_log import log_version, parse_startup_facts


async def ready_server(
    handle: ServerHandle,
    base_url: str,
    *,
    exit_code: Callable[[], Awaitable[int | None]],
    timeout_s: float,
    what: str,
    redact: Redactor,
    launcher: str,
    time_scale: float,
    default_model: str,
    exit_logs: Callable[[], Awaitable[str]] | None = None,
    read_refusals: bool = False,
) -> Server:
    """Wait for /health; on an exit or a time-out raise the LaunchError its log explains (secrets masked).

    `exit_logs` lets a launcher add what only it knows about a dead server (Docker: the kernel OOM killer).
    `read_refusals`: a refusal in the log (`refusal_in`) ends the wait at once, before the server has exited; the
    launcher then kills what is left of it (`handle.exit_code()` is still None).
    """

    def refused() -> LaunchError | None:
        return refusal_in(handle.logs(), what=what)

    try:
        ready = await wait_until_ready(
            base_url, exit_code=exit_code, timeout_s=timeout_s, logs=handle.logs,
            refused=refused if read_refusals else None,
        )  # fmt: skip
    except LaunchError as e:
        raise _with_version(e, handle.logs(), redact) from None
    except ServerExited as e:
        logs = await exit_logs() if exit_logs is not None else handle.logs()
        raise _with_version(classify_startup_exit(logs, e.code, what=what), logs, redact) from None
    except StartTimedOut:
        logs = handle.logs()
        raise _with_version(start_timeout_error(logs, timeout_s, what=what), logs, redact) from None
    handle.mark_ready()
    facts = parse_startup_facts(handle.logs(), startup_seconds=ready.startup_seconds)
    if ready.version is not None:
        # The route answers for the server that runs; the banner is only what its log said (or None).
        facts = facts.model_copy(update={"vllm_version": ready.version})
    return Server(
        base_url=base_url,
        model=ready.served_model or default_model,
        facts=facts,
        time_scale=time_scale,
        handle=handle,
        redactor=redact,
        launcher=launcher,
    )


def _with_version(error: LaunchError, logs: str, redact: Redactor) -> LaunchError:
    """The error masked, with the version the whole log's banner names (a tail alone would have lost it)."""
    error.vllm_version = log_version(logs)
    return redact_error(error, redact)
