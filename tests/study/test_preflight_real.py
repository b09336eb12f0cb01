"""A study that cannot measure stops at once, on real vLLM (the CPU build, the tiny model), as a user runs it.

Three jobs the server refuses whatever the flags, each stopped in the baseline's server start with one message, a
non-zero exit and no measurement recorded:

- a chat workload for a model without a chat template (vLLM answers 400 "... you must provide a chat template ...");
  the load asks for the name the server serves (read from /v1/models), so the realistic "wrong model" is the next:
- an API key in the server's environment (`VLLM_API_KEY`, passed by name): vLLM answers 401 to every /v1 request;
- dataset prompts + output longer than a fixed max_model_len: vLLM 0.32 shortens the output and answers 200 (fixed
  lengths that cannot fit are refused by the job check before any start).

The jobs fixed (a model with a chat template, max_model_len room for the lengths) pass the preflight in the
baseline's own server: test_tune_real.py's study is such a job, and says so in its log.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.real_vllm import START_LIMIT_S, process_target, vllm_env

pytestmark = pytest.mark.real_vllm


def _job(vllm_python: Path, model: Path, name: str, **changes: Any) -> dict[str, Any]:
    process: dict[str, Any] = process_target(vllm_python)
    doc: dict[str, Any] = {
        "study": {"name": name},
        "target": {
            "launcher": "process",
            "model": str(model),
            "gpu": "cpu",
            "startup_timeout": f"{START_LIMIT_S:.0f}s",
            "process": process,
        },
        "space": {"max_model_len": 1024, "max_num_seqs": {"choices": [4, 8]}},
        "workload": {"input_len": 64, "output_len": 16, "seed": 3},
        "arrival": {"concurrency": 2, "requests": 4},
        "slos": ["e2e_p95 <= 120s", "success_rate >= 0.99"],
        "request_timeout": "120s",
        "budget": {"n_trials": 2, "confirm": 0},  # the preflight is under test, not the confirmation
        "sampler": {"name": "random", "seed": 0},
    }
    doc.update(changes)
    return doc


def _start(doc: dict[str, Any], folder: Path, **env: str) -> tuple[subprocess.Popen[str], Path]:
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner", "tune", str(job), "--log-file", str(folder / "tune.log")],
        cwd=folder,
        env={**vllm_env(), "COLUMNS": "400", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, job


Tuned = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def refused(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tuned]:
    """The three jobs tuned side by side, as three users' studies would be: each one real vLLM start (about half a
    minute of CI), so the module takes about one start's time rather than three."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("no-template", "api-key", "shortened")}

    base_model = folders["no-template"] / "tiny-base"
    shutil.copytree(tiny_model, base_model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    chat = {"input_len": 64, "output_len": 16, "api": "chat"}
    no_template = _job(vllm_python, base_model, "no-template", workload=chat)

    api_key = _job(vllm_python, tiny_model, "api-key")
    api_key["target"]["process"]["env"] = ["VLLM_CPU_KVCACHE_SPACE", "VLLM_API_KEY"]

    # 200 + 100 tokens under max_model_len 256: vLLM 0.32 answers 200 with the output cut to what fits. Fixed
    # lengths the job check refuses before a start; a dataset's are only estimated, so the server's answer decides.
    (folders["shortened"] / "long.jsonl").write_text(
        "".join(json.dumps({"prompt": "alpha " * 200, "output_len": 100}) + "\n" for _ in range(4))
    )
    shortened = _job(vllm_python, tiny_model, "shortened", workload={"dataset": "long.jsonl", "seed": 3})
    shortened["space"]["max_model_len"] = 256

    started = {
        "no-template": _start(no_template, folders["no-template"]),
        "api-key": _start(api_key, folders["api-key"], VLLM_API_KEY="sk-preflight-test"),
        "shortened": _start(shortened, folders["shortened"]),
    }
    done: dict[str, Tuned] = {}
    try:
        for name, (proc, job) in started.items():
            out, err = proc.communicate(timeout=3600)  # a bound on a hung run, not an assertion on speed
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), job)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _trials(job: Path) -> list[dict[str, Any]]:
    run = subprocess.run(
        [sys.executable, "-m", "tuner", "trials", "--job", str(job), "--json"],
        cwd=job.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    return list(doc["trials"] if isinstance(doc, dict) else doc)


def _stopped_in_the_first_start(run: subprocess.CompletedProcess[str], job: Path, *said: str) -> str:
    """The run's one message; asserts the stop: non-zero, no traceback, one trial (the baseline), nothing measured."""
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "Traceback" not in out
    error = next(line for line in run.stderr.splitlines() if line.startswith("error:"))
    assert "the workload is invalid for this server" in error, out[-3000:]
    for text in said:
        assert text in error, error
    (trial,) = _trials(job)  # one server start: the baseline's
    assert trial["baseline"] and trial["outcome"] == "workload_invalid" and trial["throughput"] is None, trial
    return error


def test_a_chat_workload_for_a_model_without_a_chat_template_stops_the_study(refused: dict[str, Tuned]) -> None:
    run, job = refused["no-template"]
    said = ("POST /v1/chat/completions", "HTTP 400", "chat template", "workload.api: completions")
    _stopped_in_the_first_start(run, job, *said)


def test_an_api_key_the_server_wants_stops_the_study(refused: dict[str, Tuned]) -> None:
    run, job = refused["api-key"]
    _stopped_in_the_first_start(run, job, "HTTP 401", "VLLM_API_KEY")
    assert "sk-preflight-test" not in run.stdout + run.stderr


def test_an_output_the_server_shortens_stops_the_study(refused: dict[str, Tuned]) -> None:
    run, job = refused["shortened"]
    _stopped_in_the_first_start(run, job, "asked 100 output tokens, got", "space.max_model_len at least")
