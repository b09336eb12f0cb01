"""Mutations of the shipped job files: every one is refused by `tuner tune` with exit 2, one line per problem naming
the field path, no traceback, and nothing written to the storage (the SQLite file that would sit beside the job)."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tuner.cli import main
from tuner.config import load_job
from tuner.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[2] / "search_spaces"
DEMO = "emulator-demo.yaml"  # emulator launcher, fixed lengths, max_model_len 4096
DOCKER = "rtx4090-llama-3.1-8b.yaml"  # docker launcher, a uniform input length, max_model_len choices


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    mutate: Callable[[str], bytes]
    expected: tuple[str, ...]  # one substring a line: the number of lines the error must have

    def __str__(self) -> str:
        return self.name


def text(old: str, new: str) -> Callable[[str], bytes]:
    def mutate(source: str) -> bytes:
        assert old in source, old
        return source.replace(old, new, 1).encode()

    return mutate


def raw(make: Callable[[str], bytes]) -> Callable[[str], bytes]:
    return make


def edit(*changes: tuple[str, Any]) -> Callable[[str], bytes]:
    """Set (or, with DELETE, remove) dotted paths of the parsed job, then write it back as YAML."""

    def mutate(source: str) -> bytes:
        data = copy.deepcopy(yaml.safe_load(source))
        for dotted, value in changes:
            *parents, last = dotted.split(".")
            node = data
            for key in parents:
                node = node.setdefault(key, {})
            if value is DELETE:
                node.pop(last)
            else:
                node[last] = value
        return yaml.safe_dump(data, sort_keys=False).encode()

    return mutate


DELETE = object()

CASES = [
    # encodings and YAML
    Case(
        "latin-1 byte",
        DEMO,
        raw(lambda s: s.encode().replace(b"name: emulator-demo", b"name: caf\xe9-demo")),
        ("line 8: byte 0xe9 is not UTF-8",),
    ),
    Case("latin-1 file", DEMO, raw(lambda s: s.replace("demo", "démo").encode("latin-1")), ("line 6: byte 0xe9",)),
    Case("utf-16 file", DEMO, raw(lambda s: s.encode("utf-16")), ("is not UTF-8",)),
    Case(
        "duplicate top key",
        DEMO,
        text("objective: throughput", "objective: throughput\nobjective: max_rate"),
        ("objective: duplicate key at line",),
    ),
    Case(
        "duplicate flag",
        DEMO,
        text("  max_model_len: 4096", "  max_model_len: 4096\n  max_model_len: 2048"),
        ("space.max_model_len: duplicate key",),
    ),
    Case(
        "duplicate nested key",
        DEMO,
        text("  launcher: emulator", "  launcher: emulator\n  launcher: docker"),
        ("target.launcher: duplicate key",),
    ),
    Case(
        "two duplicates",
        DEMO,
        text("budget: {n_trials: 12}", "budget: {n_trials: 12, n_trials: 3}\nstop_early: true\nstop_early: false"),
        ("budget.n_trials: duplicate key", "stop_early: duplicate key"),
    ),
    Case("unclosed bracket", DEMO, text("budget: {n_trials: 12}", "budget: {n_trials: 12"), ("not valid YAML",)),
    Case("tab indent", DEMO, text("  name: emulator-demo", "\tname: emulator-demo"), ("not valid YAML",)),
    Case("two documents", DEMO, raw(lambda s: (s + "\n---\nstudy: {name: x}\n").encode()), ("not valid YAML",)),
    Case("nul byte", DEMO, raw(lambda s: s.replace("demo", "de\0mo").encode()), ("not valid YAML",)),
    Case("recursive alias", DEMO, text("slos: [", "extra: &a [*a]\nslos: ["), ("extra: unknown field",)),
    Case("a list", DEMO, raw(lambda s: b"- study\n- target\n"), ("a job file is a mapping",)),
    Case("empty file", DEMO, raw(lambda s: b""), ("a job file is a mapping",)),
    # types and ranges
    Case("study name number", DEMO, edit(("study.name", 5)), ("study.name: Input should be a valid string",)),
    Case("study name empty", DEMO, edit(("study.name", "")), ("study.name:",)),
    Case("heartbeat zero", DEMO, edit(("study.heartbeat_interval", 0)), ("study.heartbeat_interval:",)),
    Case("trials words", DEMO, edit(("budget.n_trials", "many")), ("budget.n_trials: Input should be a valid int",)),
    Case("trials zero", DEMO, edit(("budget.n_trials", 0)), ("budget.n_trials: Input should be greater than",)),
    Case("timeout soon", DEMO, edit(("budget.timeout", "soon")), ("budget.timeout: 'soon' is not a duration",)),
    Case("timeout negative", DEMO, edit(("budget.timeout", -5)), ("budget.timeout: -5: a duration must be > 0",)),
    Case("concurrency zero", DEMO, edit(("arrival.concurrency", 0)), ("arrival.concurrency: Input should be greater",)),
    Case("concurrency list", DEMO, edit(("arrival.concurrency", [1, 2])), ("arrival.concurrency:",)),
    Case("rate and concurrency", DEMO, edit(("arrival.rate", 2.0)), ("arrival: give exactly one of",)),
    Case("arrival missing", DEMO, edit(("arrival", DELETE)), ("arrival: required field is missing",)),
    Case("input zero", DEMO, edit(("workload.input_len", 0)), ("workload.input_len: Input should be greater than",)),
    Case("output negative", DEMO, edit(("workload.output_len", -3)), ("workload.output_len: Input should be greater",)),
    Case("input list", DEMO, edit(("workload.input_len", [1])), ("workload.input_len: [1] is not allowed",)),
    Case(
        "input dist typo",
        DEMO,
        edit(("workload.input_len", {"dist": "uniform", "low": 1, "hgih": 5})),
        ("workload.input_len.hgih: unknown field; allowed: dist, low, high; did you mean high?",),
    ),
    Case(
        "input dist unknown",
        DEMO,
        edit(("workload.input_len", {"dist": "gamma", "value": 5})),
        ("workload.input_len:",),
    ),
    Case(
        "uniform reversed",
        DOCKER,
        edit(("workload.input_len", {"dist": "uniform", "low": 900, "high": 100})),
        ("workload.input_len: uniform length: high (100) must be >= low (900)",),
    ),
    Case("dataset missing", DEMO, edit(("workload.dataset", "nope.jsonl")), ("nope.jsonl: cannot read it",)),
    Case("prefix negative", DEMO, edit(("workload.prefix_len", -1)), ("workload.prefix_len:",)),
    Case("api grpc", DEMO, edit(("workload.api", "grpc")), ("workload.api: Input should be 'completions' or 'chat'",)),
    Case("slo unit", DEMO, edit(("slos", ["e2e_p95 <= 20 parsecs"])), ("slos[0]: SLO 'e2e_p95 <= 20 parsecs'",)),
    Case("slos a string", DEMO, edit(("slos", "e2e_p95 <= 5s")), ("slos: Input should be a valid list",)),
    Case("objective", DEMO, edit(("objective", "fastest")), ("objective: Input should be 'throughput', 'max_rate'",)),
    Case("sampler", DEMO, edit(("sampler.name", "cmaes")), ("sampler.name: Input should be 'tpe'",)),
    Case("population", DEMO, edit(("sampler.population_size", 1)), ("sampler.population_size:",)),
    Case("margin", DEMO, edit(("feasibility.margin", 2)), ("feasibility.margin: Input should be less than",)),
    Case("request timeout", DEMO, edit(("request_timeout", "never")), ("request_timeout: 'never' is not a duration",)),
    Case("stop early maybe", DEMO, edit(("stop_early", "maybe")), ("stop_early: Input should be a valid boolean",)),
    Case("launcher", DEMO, edit(("target.launcher", "k8s")), ("target.launcher: Input should be 'emulator'",)),
    Case("gpu number", DEMO, edit(("target.gpu", 5)), ("target.gpu: 5 is not allowed",)),
    Case("gpu unknown", DEMO, edit(("target.gpu", "v100")), ("target.gpu: unknown GPU 'v100'",)),
    Case("model unknown", DEMO, edit(("target.model", "no-such-model")), ("target.model: unknown model",)),
    Case("time scale zero", DEMO, edit(("target.emulator.time_scale", 0)), ("target.emulator.time_scale:",)),
    Case("secret arg", DOCKER, edit(("target.docker.extra_args", ["--api-key", "sk-1"])), ("env: [VLLM_API_KEY]",)),
    Case("env value", DOCKER, edit(("target.docker.env", ["HF_TOKEN=hf_x"])), ("target.docker.env:",)),
    # unknown keys, with the name meant
    Case(
        "top typo",
        DEMO,
        edit(("workloads", {"input_len": 5})),
        ("; did you mean workload?",),
    ),
    Case(
        "budget typo",
        DEMO,
        edit(("budget.timout", "1h")),
        (
            "budget.timout: unknown field; allowed: n_trials, timeout, confirm, stop_when_unreachable; "
            "did you mean timeout?",
        ),
    ),
    Case("emulator typo", DEMO, edit(("target.emulator.time_scal", 2)), ("; did you mean time_scale?",)),
    Case("arrival typo", DEMO, edit(("arrival.concurency", 4)), ("; did you mean concurrency?",)),
    Case("sampler typo", DEMO, edit(("sampler.sed", 4)), ("; did you mean seed?",)),
    Case("docker typo", DOCKER, edit(("target.docker.imag", "x")), ("; did you mean image?",)),
    Case(
        "flag typo",
        DEMO,
        edit(("space.max_num_sequences", 8)),
        ("space.max_num_sequences: not an argument of vLLM 0.32.0; did you mean max_num_seqs?",),
    ),
    Case("flag outside vLLM", DEMO, edit(("space.swap_space", 4)), ("target.emulator.extra_args, e.g. [--swap-space",)),
    Case("choices typo", DEMO, edit(("space.max_num_seqs", {"choice": [8, 16]})), ("(did you mean choices?)",)),
    Case(
        "range typo",
        DEMO,
        edit(("space.max_num_seqs", {"low": 8, "hihg": 64})),
        ("space.max_num_seqs.hihg: unknown field; allowed: low, high, step, log; did you mean high?",),
    ),
    # the space's values
    Case(
        "choices empty",
        DEMO,
        edit(("space.max_num_seqs", {"choices": []})),
        ("space.max_num_seqs.choices: choices must list at least one value",),
    ),
    Case(
        "choices nested",
        DEMO,
        edit(("space.max_num_seqs", {"choices": [[1, 2]]})),
        ("space.max_num_seqs.choices[0]: [1, 2] is not allowed",),
    ),
    Case("range reversed", DEMO, edit(("space.max_num_seqs", {"low": 64, "high": 8})), ("low (64) must be <= high",)),
    Case("range list", DEMO, edit(("space.max_num_seqs", {"low": [8], "high": 64})), ("space.max_num_seqs.low:",)),
    Case(
        "step zero",
        DEMO,
        edit(("space.max_num_seqs", {"low": 8, "high": 64, "step": 0})),
        ("space.max_num_seqs: step must be > 0, got 0",),
    ),
    Case(
        "step and log",
        DEMO,
        edit(("space.max_num_seqs", {"low": 8, "high": 64, "step": 8, "log": True})),
        ("`step` or `log: true`, not both",),
    ),
    Case("utilisation", DEMO, edit(("space.gpu_memory_utilization", 1.5)), ("a fraction in (0, 1]",)),
    Case("block size", DEMO, edit(("space.block_size", 7)), ("space.block_size: 7 is not allowed",)),
    Case("kv dtype", DEMO, edit(("space.kv_cache_dtype", "fp4")), ("space.kv_cache_dtype: 'fp4' is not allowed",)),
    Case("bool flag number", DEMO, edit(("space.enable_prefix_caching", 4)), ("use true or false",)),
    Case("bool flag range", DEMO, edit(("space.enforce_eager", {"low": 0, "high": 1})), ("not a range",)),
    Case("vLLM switch value", DEMO, edit(("space.disable_log_stats", 5)), ("is a switch; give true, false",)),
    Case("vLLM value switch", DEMO, edit(("space.max_logprobs", True)), ("takes a value, not true",)),
    Case("length above model", DEMO, edit(("space.max_model_len", "400k")), ("400000 is above the model's limit",)),
    Case("nothing to tune", DEMO, edit(("space", {"max_model_len": 4096})), ("space: nothing to tune",)),
    Case(
        "grid of a range",
        DEMO,
        edit(("sampler.name", "grid"), ("space.max_num_seqs", {"low": 8, "high": 64, "log": True})),
        ("grid sampler needs a finite set",),
    ),
    # contradictions: no request fits any trial's max_model_len
    Case(
        "length 10",
        DEMO,
        edit(("space.max_model_len", 10)),
        ("max_model_len 10 is shorter than every request of the workload (at least 1216 tokens",),
    ),
    Case("output beyond", DEMO, edit(("workload.output_len", 5000)), ("raise max_model_len to at least 6024",)),
    Case("range below", DEMO, edit(("space.max_model_len", {"low": 256, "high": 1024})), ("the largest is 1024",)),
    Case(
        "choices below",
        DOCKER,
        edit(("space.max_model_len", {"choices": [128, 256]})),
        ("shorter than every request of the workload (at least 512 tokens",),
    ),
    # several problems: a line each
    Case(
        "three problems",
        DEMO,
        edit(("budget.timout", 1), ("arrival.concurrency", 0), ("objective", "x")),
        ("arrival.concurrency:", "objective:", "budget.timout:"),
    ),
    Case(
        "two space problems",
        DEMO,
        edit(("space.block_size", 7), ("space.max_num_sequences", 8)),
        ("space.max_num_sequences:", "space.block_size:"),
    ),
]


def write_case(tmp_path: Path, case: Case) -> Path:
    job = tmp_path / "job.yaml"
    job.write_bytes(case.mutate((SHIPPED / case.base).read_text()))
    return job


def tune_exit(job: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", ["tuner", "tune", str(job)])
    with pytest.raises(SystemExit) as info:
        main()
    return int(info.value.code or 0)


def test_the_table_is_large_and_named_once() -> None:
    assert len(CASES) >= 50
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_bad_job_file_is_one_line_a_problem_exit_2_nothing_stored(
    tmp_path: Path, case: Case, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = write_case(tmp_path, case)
    with pytest.raises(ConfigError):  # first without the CLI: a valid mutation must never start a study
        load_job(job)
    capsys.readouterr()
    assert tune_exit(job, monkeypatch) == 2
    out = capsys.readouterr()
    lines = out.err.rstrip("\n").split("\n")
    assert len(lines) == len(case.expected), out.err
    assert lines[0].startswith("error: ")
    for line in lines:
        assert f"{job}: " in line, line  # the file, then the field path
    for expected in case.expected:
        assert sum(expected in line for line in lines) == 1, (expected, out.err)
    assert "Traceback" not in out.err + out.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no storage file


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    job = write_case(tmp_path, CASES[0])
    with pytest.raises(ConfigError):  # never a study, whatever the table's first case becomes
        load_job(job)
    tuner = Path(sys.executable).parent / "tuner"
    done = subprocess.run([str(tuner), "tune", str(job)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "is not UTF-8" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
