"""Secret values (passed to servers by environment-variable name) never leave a launcher in clear."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from tuner.errors import LaunchError

# Shorter values are flags like "1" or "true", not secrets; replacing them would mangle every log.
MIN_SECRET_LENGTH = 8
MASK = "***"


class Redactor:
    """Replaces each known secret value by *** in any text handed to a person, a log or a database."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        # Longest first, so a secret that contains another is masked whole.
        self._values = sorted({v for v in values if len(v) >= MIN_SECRET_LENGTH}, key=len, reverse=True)

    @classmethod
    def for_env(cls, names: Iterable[str], environ: Mapping[str, str] | None = None) -> Redactor:
        env = os.environ if environ is None else environ
        return cls(env[n] for n in names if n in env)

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, MASK)
        return text


def redact_error(error: LaunchError, redact: Redactor) -> LaunchError:
    """The same error with secret values masked in its message and log tail."""
    return LaunchError(
        redact(str(error)),
        error.reason,
        redact(error.log_tail),
        estimated_max_model_len=error.estimated_max_model_len,
        vllm_version=error.vllm_version,
    )
