"""`tuner calibrate`: the probe through tuner's own load client against a server, the profile it writes, and its
one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.calibration.test_fit import TRUE, _profile
from tests.conftest import run_main
from tests.servers import free_port, wait_healthy
from tuner.calibration.fit import Measured, error_figures
from tuner.calibration.probe import decode_unseen
from tuner.step_profile import load_profile


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    code, out, err = run_main(args, capsys, monkeypatch)
    return code, out + err


@pytest.fixture
def emulated_cpu_server(tmp_path: Path) -> Iterator[str]:
    """The emulator as a vLLM CPU server with known step times, in its own process (the probe's event loop is the
    CLI's)."""
    known = tmp_path / "known.json"
    _profile(TRUE).write(known)
    port = free_port()
    cmd = [
        sys.executable, "-m", "tuner.emulator", "--device", "cpu", "--model", "llama-3.1-8b", "--served-model-name",
        "m", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), "--profile", str(known),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        why = wait_healthy(base, proc, 300)  # its start-up is 11 s of wall time, more on a busy machine
        assert why is None, f"the emulated server: {why}"
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_calibrate_probes_a_server_and_writes_a_profile_the_emulator_reads(
    emulated_cpu_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "fitted.json"
    args = ["calibrate", "--url", emulated_cpu_server + "/v1", "-o", str(out), "--device", "cpu",
            "--model-config", "llama-3.1-8b", "--concurrency", "1,4", "--input-len", "64,256", "--output-len", "8",
            "--rounds", "1"]  # fmt: skip
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert "c=4   in=256" in text and f"wrote {out}" in text
    profile = load_profile(out)
    assert profile.device == "cpu" and profile.model == "m" and profile.block_size == 128
    assert profile.num_gpu_blocks == 64  # 1 GiB of 128-KiB tokens, from the server's vllm:cache_config_info
    assert profile.fitted_from.source == "probe" and profile.fitted_from.url == emulated_cpu_server
    assert [(p.concurrency, p.input_len) for p in profile.fitted_from.points] == [(1, 64), (4, 64), (1, 256), (4, 256)]
    assert all(p.measured_output_tok_s > 0 for p in profile.fitted_from.points)
    # Whatever the machine's noise did to the figures (and however the fit split them among its terms), the profile
    # predicts decode time wherever the client measured some.
    assert all(p.predicted_tpot_mean_s > 0 for p in profile.fitted_from.points if p.measured_tpot_mean_s > 0)
    # the error is over what was measured: TTFT and duration at each point, TPOT where a reply came in pieces
    timed = sum(p.measured_tpot_mean_s > 0 for p in profile.fitted_from.points)
    assert f"over {8 + timed} figures at 4 points" in text


@pytest.mark.parametrize(
    ("args", "code", "pattern"),
    [
        (["--url", "http://127.0.0.1:9", "-o", "x.json"], 1, "cannot reach http://127.0.0.1:9"),
        (["--url", "nope", "-o", "x.json"], 2, "--url 'nope': give the server's address"),
        (["--url", "http://h:1", "-o", "x.json", "--concurrency", "0,4"], 2, "--concurrency '0,4': give whole numbers"),
        (["--url", "http://h:1", "-o", "x.json", "--input-len", "512"], 2, "at least two concurrencies and two prompt"),
        (["--url", "http://h:1", "-o", "x.json", "--output-len", "1"], 2, "--output-len 1: at least 2 tokens"),
        (["--url", "http://h:1", "-o", "x.json", "--device", "v100"], 2, "known GPUs"),
    ],
)
def test_bad_input_is_one_line(
    args: list[str], code: int, pattern: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    got, text = run_cli(["calibrate", *args], capsys, monkeypatch)
    assert got == code, text
    assert pattern in text and "Traceback" not in text


def test_a_probe_that_never_saw_two_pieces_of_a_reply_says_decode_went_untimed() -> None:
    def point(tpot_s: float) -> Measured:
        return Measured(ttft_mean_s=0.05, tpot_mean_s=tpot_s, duration_s=1.0, output_tokens=32)

    warning = decode_unseen([point(0.0), point(0.0)])
    assert warning is not None and warning.startswith("warning: every reply came in one piece")
    assert "--output-len" in warning and "\n" not in warning
    assert decode_unseen([point(0.0), point(0.004)]) is None  # one point's gaps are enough to time a step
    # the fit's error is over the means it had: a point without TPOT gives two, not three
    assert error_figures([point(0.0), point(0.004)]) == 5
