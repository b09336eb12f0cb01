"""`tuner bench` as a user runs it: against the emulator, a broken server, nothing at all, and bad command lines."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest
from load_fakes import BrokenServer

from tests.conftest import run_main
from tests.servers import free_port

run_cli = run_main


async def bench_process(*args: str) -> tuple[int, str, str]:
    """`tuner bench ARGS` in its own process: the fake server the test serves keeps this event loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tuner", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    out_b, err_b = await asyncio.wait_for(proc.communicate(), 300)  # not forever
    assert proc.returncode is not None
    return proc.returncode, out_b.decode(), err_b.decode()


def test_bench_starts_the_emulator_without_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out_file = tmp_path / "out.json"
    code, out, _err = run_cli(
        ["bench", "--concurrency", "4", "--requests", "12", "--warmup", "2", "--input-len", "128",
         "--output-len", "16", "--time-scale", "50", "--gpu", "l4", "--slo", "e2e_p95<=30s", "--json", str(out_file),
         "--timeout", "3000"],  # emulated seconds: 60 s of wall time, so a busy machine's slow reply is still a reply
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, out
    assert "in-process emulator" in out and "Load summary" in out and "TTFT" in out and "diagnosis" in out
    assert "SLO e2e_p95<=30s" in out
    data = json.loads(out_file.read_text())
    assert data["model"] == "llama-3.1-8b" and data["time_scale"] == 50
    records = data["result"]["records"]
    assert len(records) == 14 and sum(r["warmup"] for r in records) == 2
    assert data["result"]["summary"]["requests_succeeded"] == 12
    assert all(r["completion_tokens"] == 16 and r["prompt_tokens"] == 128 for r in records)


def test_bench_find_max_rate_on_the_emulator(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run_cli(
        ["bench", "--find-max-rate", "--slo", "e2e_p95<=20s", "--requests", "20", "--max-steps", "2",
         "--input-len", "256", "--output-len", "32", "--time-scale", "50"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, out
    assert "Capacity search" in out and "probe (closed loop)" in out
    assert "highest rate meeting the SLOs" in out or "no rate met the SLOs" in out


async def test_bench_against_a_broken_server_reports_every_class_and_exits_0(tmp_path: Path) -> None:
    modes = ["ok", "http_500", "http_400", "cut", "garbage", "reset", "stall"]
    server = BrokenServer(modes, stall_s=20.0)
    out_file = tmp_path / "broken.json"
    async with server.serve() as base:
        code, out, err = await bench_process(
            "--url", base + "/v1", "--model", "m", "--concurrency", "3", "--requests", "14", "--timeout", "5",
            "--input-len", "8", "--output-len", "4", "--json", str(out_file),
        )  # fmt: skip
    assert code == 0, out + err
    for cls in ("http_5xx", "http_4xx", "stream_cut", "malformed_sse", "connection_reset", "timeout"):
        assert cls in out
    assert "fake 500 error" in out and "fake 400 error" in out  # one example message per class
    # it serves no /metrics: no server figures, and the reason instead
    assert "KV cache" not in out and "scrapes read nothing" in out and "/metrics: ValueError: HTTP 404" in out
    summary = json.loads(out_file.read_text())["result"]["summary"]
    assert summary["requests_succeeded"] == 2 and summary["requests_failed"] == 12


def test_unreachable_target_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _out, err = run_cli(["bench", "--url", url, "--model", "m", "--requests", "50"], capsys, monkeypatch)
    assert code == 1
    # One message (Rich may wrap it at the terminal width), no traceback.
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "cannot reach" in err and "requests refused" in " ".join(err.split())
    code, _out, err = run_cli(["bench", "--url", url], capsys, monkeypatch)  # model discovery fails first
    assert code == 1 and "cannot reach" in err and err.count("error:") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-len", "abc"], "--input-len 'abc'"),
        (["--output-len", "9-3"], "upper end"),
        (["--concurrency", "2", "--rate", "1"], "not both"),
        (["--slo", "latency<5"], "unknown metric"),
        (["--find-max-rate"], "needs at least one --slo"),
        (["--url", "localhost:8000"], "--url 'localhost:8000'"),
        (["--api", "grpc"], "--api 'grpc'"),
        (["--dataset", "/nonexistent.jsonl"], "cannot read"),
        (["--gpu", "tpu9"], "tpu9"),
        (["--concurrency", "0"], "concurrency"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _out, err = run_cli(["bench", *args], capsys, monkeypatch)
    assert code == 2
    assert message in err and "Traceback" not in err


async def test_ctrl_c_stops_and_reports_what_was_measured() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tuner", "bench", "--concurrency", "4", "--requests", "100000", "--input-len", "64",
        "--output-len", "8", "--time-scale", "50",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 30)  # the target line: the run has begun
    assert b"target" in first
    await asyncio.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out_b, err_b = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err_b.decode()
    out = out_b.decode()
    assert "(stopped early)" in out and "Load summary" in out


async def test_bench_stop_early_ends_at_the_certain_miss_and_says_why(tmp_path: Path) -> None:
    server = BrokenServer(["ok", "http_500"])
    out_file = tmp_path / "stopped.json"
    async with server.serve() as base:
        code, out, err = await bench_process(
            "--url", base + "/v1", "--model", "m", "--concurrency", "2", "--requests", "60", "--warmup", "0",
            "--input-len", "8", "--output-len", "4", "--slo", "success_rate>=0.95", "--stop-early",
            "--json", str(out_file),
        )  # fmt: skip
    assert code == 0, out + err
    assert "stopped early: success_rate>=0.95 cannot be met: 4 of the 60 measured requests failed" in out
    result = json.loads(out_file.read_text())["result"]
    assert result["slo_stop"].startswith("success_rate>=0.95 cannot be met")
    assert len(result["records"]) < 20


async def test_a_bench_where_every_request_failed_shows_them_and_exits_1() -> None:
    server = BrokenServer(["http_400"])
    async with server.serve() as base:
        code, out, err = await bench_process(
            "--url", base, "--model", "m", "--concurrency", "2", "--requests", "4", "--input-len", "8",
            "--output-len", "4",
        )  # fmt: skip
    assert code == 1, out + err
    assert "Failures" in out and "prompts not fitted" in " ".join(out.split())  # the figures are still shown
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "all 4 requests failed (4 http_4xx): HTTP 400: fake 400 error" in " ".join(err.split())


async def test_no_server_metrics_leaves_the_servers_metrics_alone(tmp_path: Path) -> None:
    server = BrokenServer(["ok"])
    server.metrics_text = "vllm:num_requests_running 1\n"
    results = {}
    async with server.serve() as base:
        for flag in ("--server-metrics", "--no-server-metrics"):
            out_file = tmp_path / f"{flag}.json"
            code, out, err = await bench_process(
                "--url", base, "--model", "m", "--concurrency", "2", "--requests", "4", "--input-len", "8",
                "--output-len", "4", "--json", str(out_file), flag,
            )  # fmt: skip
            assert code == 0, out + err
            results[flag] = json.loads(out_file.read_text())["result"]["server"]
    assert results["--server-metrics"]["samples"] >= 1 and results["--no-server-metrics"] is None
