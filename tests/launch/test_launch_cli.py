"""`tuner launch`: the facts of a good start, Ctrl-C stops the server; a failed start is one screen, exit 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_contract import MARKER_FLAG, new_marker, processes_with


def tuner(*args: str, state_dir: Path, sigint: signal.Handlers = signal.SIG_DFL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tuner", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TUNER_STATE_DIR": str(state_dir), "COLUMNS": "100"},
        # The disposition the process starts with, whatever the test runner's own is.
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


@pytest.mark.parametrize(
    ("sent", "sigint"),
    [
        (signal.SIGINT, signal.SIG_DFL),  # Ctrl-C at a terminal
        (signal.SIGINT, signal.SIG_IGN),  # `kill -INT` to a background job of a script, which starts with it ignored
        (signal.SIGTERM, signal.SIG_DFL),  # `kill`
    ],
    ids=["ctrl-c", "sigint-ignored-at-start", "sigterm"],
)
def test_launch_prints_the_facts_and_stops_on_ctrl_c(
    tmp_path: Path, sent: signal.Signals, sigint: signal.Handlers
) -> None:
    marker = new_marker()
    proc = tuner(
        "--time-scale", "100", "--", "--max-model-len", "8192", MARKER_FLAG, marker, state_dir=tmp_path,
        sigint=sigint,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C" in line:
            break
    shown = "".join(lines)
    assert "emulator server ready" in shown, shown
    # H100 + Llama-3.1-8B at 0.90 with the CUDA graphs' 0.81 GiB out of the budget (vLLM 0.32)
    assert "422,640 tokens" in shown and "51.59x at 8,192 tokens a request" in shown
    assert processes_with(marker), "the server should run until Ctrl-C"
    proc.send_signal(sent)
    rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    assert processes_with(marker) == []


def test_failed_start_shows_the_reason_and_the_log_tail(tmp_path: Path) -> None:
    proc = tuner("--gpu", "rtx4090", "--time-scale", "100", "--", "--max-model-len", "131072", state_dir=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "start failed: kv_cache_too_small" in out
    assert "the estimated maximum model length is" in out
    assert "longest max_model_len that fits" in out
    assert "log tail:" in out and "Engine core initialization failed" in out
    assert len(out.splitlines()) < 40  # one screen


def test_bad_gpus_value_is_a_one_line_config_error(tmp_path: Path) -> None:
    proc = tuner("--launcher", "docker", "--image", "tuner-test/not-here:0", "--gpus", ",", state_dir=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert out.strip().splitlines() == ["error: --gpus ',': use all, none, or device ids such as 0,1"]


def test_log_lines_on_screen_keep_writer_level_source_and_message() -> None:
    from tuner.cli.launch import _on_screen

    assert _on_screen("(Worker_TP1 pid=7) ERROR 12-02 10:15:00 [x.py:1] boom") == "Worker_TP1 ERROR [x.py:1] boom"
    assert _on_screen("(APIServer pid=7) INFO:     Application startup complete.") == (
        "APIServer INFO Application startup complete."
    )
    assert (
        _on_screen("INFO 12-02 10:15:00 [x.py:1] an older vLLM's line")
        == "INFO 12-02 10:15:00 [x.py:1] an older vLLM's line"
    )


def test_a_secret_flag_after_the_dashes_is_refused_with_the_env_name_to_use(tmp_path: Path) -> None:
    proc = tuner("--", "--max-model-len", "4096", "--api-key=sk-abcdefgh1234", state_dir=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --api-key would put the secret on the server's command")
    assert "--env VLLM_API_KEY" in lines[0] and "sk-abcdefgh1234" not in out
