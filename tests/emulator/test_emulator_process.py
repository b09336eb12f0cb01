"""The process form, `python -m tuner.emulator` / `tuner emulate`: start-up lines, start-up failures with vLLM's
messages and exit codes, connections refused until ready, argument errors, fault injection."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.cli import app
from tuner.flags import VllmFlags, resolve

EMULATOR = [sys.executable, "-m", "tuner.emulator"]
TUNER_EMULATE = [sys.executable, "-m", "tuner", "emulate"]


class _Proc:
    """An emulator process whose stdout is collected line by line in a thread."""

    def __init__(self, args: list[str], command: list[str] = EMULATOR) -> None:
        self.proc = subprocess.Popen(
            [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := rx.search(line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r}; log:\n" + "\n".join(self.lines))
                self._cond.wait(min(left, 0.1))

    def exit_code(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        self._thread.join(5)
        return code

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._thread.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def procs() -> Iterator[list[_Proc]]:
    started: list[_Proc] = []
    yield started
    for p in started:
        p.close()


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_default_max_model_len_fails_on_rtx4090_with_vllms_message(procs: list[_Proc]) -> None:
    p = _Proc(["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--time-scale", "100"])
    procs.append(p)
    assert p.exit_code() == 1
    text = "\n".join(p.lines)
    model, gpu = load_model("llama-3.1-8b"), get_gpu("rtx4090")
    plan = plan_startup(model, gpu, resolve(VllmFlags(), gpu, model))
    assert plan.estimated_max_model_len is not None and 30_000 <= plan.estimated_max_model_len <= 42_000
    assert re.search(
        r"^\(EngineCore pid=\d+\) ERROR \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] "
        r"ValueError: To serve at least one request with the "
        r"model's max seq len \(131072\), \(16\.0 GiB KV cache is needed, which is larger than the available KV "
        rf"cache memory \(\d+\.\d+ GiB\)\. Based on the available memory, the estimated maximum model length is "
        rf"{plan.estimated_max_model_len}\. Try increasing `gpu_memory_utilization` \(which also controls CPU memory "
        r"on the CPU backend\) or decreasing `max_model_len` when initializing the engine\. "
        r"See https://docs\.vllm\.ai/en/latest/configuration/conserving_memory/ for more details\.$",
        text,
        re.M,
    )
    # vLLM finds this after loading the weights and profiling, before sizing the cache
    assert text.index("Model loading took") < text.index("Available KV cache memory") < text.index("ValueError")
    assert "GPU KV cache size" not in text and "Uvicorn running" not in text


def test_start_up_lines_and_connections_refused_until_ready(procs: list[_Proc]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--max-model-len", "8192"]
    # Time scale 5: the graph capture's 7 emulated seconds are 1.4 s of wall time, for the refused connect below to
    # land in on a busy machine (at 15 it was under half a second).
    p = _Proc([*args, "--host", "127.0.0.1", "--port", str(port), "--time-scale", "5"])
    procs.append(p)
    p.wait_for(r"Starting to load model llama-3.1-8b")
    assert _refused(port)  # loading: nothing listens yet
    m = p.wait_for(r"Available KV cache memory: (\d+\.\d\d) GiB")
    available_gib = float(m.group(1))
    n = int(p.wait_for(r"GPU KV cache size: ([\d,]+) tokens").group(1).replace(",", ""))
    assert n % 16 == 0 and 30_000 <= n <= 42_000
    # N = M GiB / 128 KiB, down to whole 16-token blocks (M is printed to 2 decimals: +-0.005 GiB)
    assert abs(n - int(available_gib * 2**30 / 131072) // 16 * 16) <= 0.005 * 8192 + 16
    p.wait_for(r"Maximum concurrency for 8,192 tokens per request: \d+\.\d\dx")
    assert _refused(port)  # graph capture still to come (7 emulated seconds)
    p.wait_for(rf"Uvicorn running on http://127\.0\.0\.1:{port}")
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    text = "\n".join(p.lines)
    order = ["Model loading took", "Available KV cache memory", "GPU KV cache size", "Maximum concurrency",
             "Graph capturing finished", "Application startup complete."]  # fmt: skip
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions)
    # vLLM 0.32's shape: the writing process, level, date, source; with one GPU the worker is the engine core.
    line = r"^\(EngineCore pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] Model loading took 14\.99 GiB"
    assert re.search(line, text, re.M)
    assert re.search(r"^\(APIServer pid=\d+\) INFO:     Application startup complete\.$", text, re.M)
    p.proc.terminate()
    assert p.exit_code(10) == 0


@pytest.mark.parametrize(
    ("command", "args", "needle"),
    [
        (EMULATOR, ["--model", "llama-3.1-8b", "--gpu", "tpu-v5"], "known GPUs: rtx4090, rtx5090, l4, a100-40gb"),
        (EMULATOR, ["--model", "gpt-5"], "llama-3.1-8b, llama-3.1-8b-awq, llama-3.1-70b, qwen2.5-7b"),
        (EMULATOR, ["--model", "llama-3.1-8b", "--max-num-seqs", "many"], "--max-num-seqs: invalid int value"),
        (EMULATOR, ["--model", "llama-3.1-8b", "--max-model-len", "8q"], "--max-model-len"),
        (EMULATOR, ["--gpu", "h100-80gb"], "--model is required"),
        # an option vLLM 0.32 does not have (its --swap-space went): argparse's line, as vLLM prints it
        (EMULATOR, ["--model", "llama-3.1-8b", "--swap-space", "4"], ": error: unrecognized arguments: --swap-space"),
        (TUNER_EMULATE, ["--model", "llama-3.1-8b", "--gpu", "tpu-v5"], "known GPUs: rtx4090"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(command: list[str], args: list[str], needle: str) -> None:
    r = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_model_path_that_is_not_there_is_vllms_refusal_and_exit_1(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "model")
    r = subprocess.run([*EMULATOR, "--model", missing], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{missing}'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_tuner_emulate_help_shows_the_flags_and_an_example() -> None:
    result = CliRunner().invoke(app, ["emulate", "--help"])
    assert result.exit_code == 0
    for flag in ("--max-num-seqs", "--gpu-memory-utilization", "--max-num-batched-tokens", "--time-scale", "--gpu"):
        assert flag in result.stdout
    assert "example:" in result.stdout and "tuner emulate --model llama-3.1-8b" in result.stdout


def test_tuner_emulate_passes_its_arguments_to_the_emulator_parser() -> None:
    result = CliRunner().invoke(app, ["emulate", "--model", "gpt-5", "--gpu", "rtx4090"])
    assert result.exit_code == 2
    assert "llama-3.1-8b, llama-3.1-8b-awq" in result.stderr and "Traceback" not in result.output


def test_fault_hang_on_start_never_listens_and_never_exits(procs: list[_Proc]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _Proc(["--model", "llama-3.1-8b", "--port", str(port), "--time-scale", "1000", "--fault-hang-on-start"])
    procs.append(p)
    p.wait_for("Starting to load model")
    time.sleep(1.0)  # a normal start at this scale is ready in ~30 ms
    assert p.proc.poll() is None
    assert _refused(port)
    assert not any("Model loading took" in line for line in p.lines)


def test_fault_crash_after_requests_exits_1_with_a_cuda_error(procs: list[_Proc]) -> None:
    p = _Proc(["--model", "llama-3.1-8b", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "0",
               "--time-scale", "100", "--fault-crash-after-requests", "2"])  # fmt: skip
    procs.append(p)
    url = p.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
    assert p.exit_code(20) == 1
    assert any("CUDA error: an illegal memory access was encountered" in line for line in p.lines)


def test_unknown_vllm_flags_are_accepted_with_a_warning(procs: list[_Proc]) -> None:
    p = _Proc(["--model", "llama-3.1-8b", "--max-model-len", "4k", "--port", "0", "--host", "127.0.0.1",
               "--time-scale", "1000", "--max-logprobs", "8", "--disable-custom-all-reduce"])  # fmt: skip
    procs.append(p)
    line = p.wait_for(r"^\(APIServer pid=\d+\) WARNING .*--max-logprobs 8 --disable-custom-all-reduce").string
    assert "ignores" in line
    p.wait_for("Using max model len 4000")
    p.wait_for("Uvicorn running on")
