from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from tuner.config import Job, job_schema, load_job, parse_duration, parse_job
from tuner.errors import ConfigError
from tuner.load import UniformLength, Workload
from tuner.study.samplers import sampler_name

GOOD = """
study: {name: demo}
target: {launcher: emulator, model: llama-3.1-8b, gpu: l4, emulator: {time_scale: 20}}
space:
  max_num_seqs: {low: 8, high: 128, log: true}
  gpu_memory_utilization: {low: 0.85, high: 0.95, step: 0.05}
  max_model_len: 4k
workload: {input_len: 256, output_len: 64}
arrival: {concurrency: 8, requests: 40}
slos: ["e2e_p95 <= 20s", "success_rate >= 0.99"]
budget: {n_trials: 5, timeout: 30m}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_job_loads_with_defaults_and_storage_beside_the_file(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, GOOD))
    assert job.study.name == "demo" and job.target.emulator.time_scale == 20
    assert job.budget.timeout == 1800 and job.request_timeout == 60
    assert job.storage_url() == f"sqlite:///{(tmp_path / 'demo.db').resolve()}"
    assert job.primary_latency() == "e2e_p95"
    # no sampler named: the twin, since the emulated GPU and the model are known to the start-up arithmetic
    assert job.sampler.name is None and sampler_name(job) == "twin" and job.objective == "throughput"
    assert job.search_space().fixed == {"max_model_len": 4000}
    record = job.as_record()
    assert record["study"]["name"] == "demo" and "source" not in record


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_job(write(tmp_path, text))
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("budget: {n_trials: 5, timeout: 30m}", "budget: {n_trials: 5, timout: 30m}"),
            "budget.timout: unknown field; allowed: n_trials, timeout, confirm, stop_when_unreachable; "
            "did you mean timeout?",
        ),
        (("slos: [", "sampler: {name: cmaes}\nslos: ["), "sampler.name: Input should be 'tpe', 'gp', 'nsga2'"),
        (("gpu: l4", "gpu: v100"), "target.gpu: unknown GPU 'v100'; known GPUs: rtx4090"),
        (
            ("e2e_p95 <= 20s", "e2e_p95 <= 20 parsecs"),
            "slos[0]: SLO 'e2e_p95 <= 20 parsecs': unit 'parsecs'",
        ),
        (("timeout: 30m", "timeout: soon"), "budget.timeout: 'soon' is not a duration"),
        (("max_model_len: 4k", "max_model_len: 400k"), "space.max_model_len: 400000 is above the model's limit"),
        (("launcher: emulator", "launcher: k8s"), "target.launcher: Input should be 'emulator', 'process' or 'docker'"),
        (("arrival: {concurrency: 8, requests: 40}", "arrival: {requests: 40}"), "arrival: give exactly one of"),
        (("study: {name: demo}\n", ""), "study: required field is missing"),
    ],
)
def test_bad_job_names_the_file_the_field_and_what_is_allowed(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    text = GOOD.replace(*change)
    assert text != GOOD
    message = error_of(tmp_path, text)
    assert str(tmp_path / "job.yaml") in message
    assert expected in message


def test_yaml_syntax_error_gives_the_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, GOOD + "\nspace: [unclosed\n")
    assert "not valid YAML at line" in message


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_job(tmp_path / "nope.yaml")
    assert "a job file is a mapping" in error_of(tmp_path, "- just\n- a list\n")


def test_secrets_are_names_only(tmp_path: Path) -> None:
    text = GOOD.replace("launcher: emulator", "launcher: docker, docker: {env: [HF_TOKEN]}")
    job = load_job(write(tmp_path, text))
    assert job.target.docker.env == ["HF_TOKEN"]
    bad = GOOD.replace("launcher: emulator", "launcher: docker, docker: {env: ['HF_TOKEN=hf_abc']}")
    message = error_of(tmp_path, bad)
    assert "target.docker.env: 'HF_TOKEN=hf_abc' is not an environment variable name" in message


@pytest.mark.parametrize(
    ("launcher", "args", "env"),
    [
        ("docker", "['--api-key', 'sk-123456789']", "VLLM_API_KEY"),
        ("process", "['--hf-token=hf_abcdefgh']", "HF_TOKEN"),
        ("emulator", "['--api-key', 'sk-123456789']", "VLLM_API_KEY"),
    ],
)
def test_secret_flags_in_extra_args_are_refused_with_the_env_name_to_use(
    tmp_path: Path, launcher: str, args: str, env: str
) -> None:
    text = GOOD.replace("emulator: {time_scale: 20}", f"{launcher}: {{extra_args: {args}}}").replace(
        "launcher: emulator", f"launcher: {launcher}"
    )
    message = error_of(tmp_path, text)
    assert f"target.{launcher}.extra_args:" in message and f"env: [{env}]" in message
    assert "sk-123456789" not in message and "hf_abcdefgh" not in message  # the error does not echo the secret


def test_grid_sampler_needs_a_finite_space(tmp_path: Path) -> None:
    text = GOOD.replace("slos: [", "sampler: {name: grid}\nslos: [")
    assert "grid sampler needs a finite set of values" in error_of(tmp_path, text)


def test_latency_metric_must_be_a_latency(tmp_path: Path) -> None:
    text = GOOD.replace("slos: [", "latency_metric: success_rate\nslos: [")
    assert "latency_metric 'success_rate' is not a latency" in error_of(tmp_path, text)
    job = load_job(write(tmp_path, GOOD.replace("slos: [", "latency_metric: ttft_p95\nslos: [")))
    assert job.primary_latency() == "ttft_p95"


def test_schema_describes_the_job_file() -> None:
    schema = job_schema()
    assert {"study", "target", "space", "workload", "arrival", "slos", "budget", "sampler"} <= set(schema["properties"])
    assert "source" not in schema["properties"]
    assert set(schema["required"]) == {"study", "target", "space", "arrival"}


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("8h", 28800), (1.5, 1.5)])
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_shipped_job_files_validate() -> None:
    root = Path(__file__).resolve().parents[2] / "search_spaces"
    files = sorted(root.glob("*.yaml"))
    assert len(files) >= 4
    for f in files:
        job = load_job(f)
        job.search_space().baseline()


def test_a_range_partly_below_the_longest_request_is_a_note_not_an_error(tmp_path: Path) -> None:
    text = GOOD.replace("max_model_len: 4k", "max_model_len: {low: 256, high: 2048}")
    notes = load_job(write(tmp_path, text)).search_space().notes
    assert any("values from 256 are below the workload's longest request (320 tokens)" in n for n in notes)


def test_a_length_no_request_fits_names_the_requests_and_the_change(tmp_path: Path) -> None:
    message = error_of(tmp_path, GOOD.replace("max_model_len: 4k", "max_model_len: 100"))
    assert message.count("\n") == 0
    assert (
        "space.max_model_len: max_model_len 100 is shorter than every request of the workload (at least 320" in message
    )
    assert "no trial can meet 'success_rate >= 0.99'; raise max_model_len to at least 320" in message


def test_a_length_too_many_requests_exceed_misses_the_success_rate_and_says_how_long(tmp_path: Path) -> None:
    # Prompts of 100..600 tokens + 64: about half of the 40 measured requests are over 400 tokens.
    text = GOOD.replace("max_model_len: 4k", "max_model_len: 400").replace(
        "input_len: 256", "input_len: {dist: uniform, low: 100, high: 600}"
    )
    workload = Workload(input_len=UniformLength(low=100, high=600), output_len=64)
    totals = workload.request_tokens(40)
    too_long = sum(t > 400 for t in totals)
    assert 0 < too_long < 40  # some fit: not the every-request case
    message = error_of(tmp_path, text)
    assert message.count("\n") == 0
    assert f"max_model_len 400 is shorter than {too_long} of the workload's 40 measured requests" in message
    # 0.99 of 40 allows no failure: every request must fit, so the longest decides
    assert f"no trial can meet 'success_rate>=0.99'; raise max_model_len to at least {max(totals)}" in message


def test_a_length_few_enough_requests_exceed_stays_a_note(tmp_path: Path) -> None:
    # success_rate >= 0.5 allows 20 of 40 failures: the same space is then a note, not an error.
    text = (
        GOOD.replace("max_model_len: 4k", "max_model_len: {choices: [400, 512]}")
        .replace("input_len: 256", "input_len: {dist: uniform, low: 100, high: 600}")
        .replace("success_rate >= 0.99", "success_rate >= 0.5")
    )
    job = load_job(write(tmp_path, text))
    assert sum(t > 512 for t in job.workload.request_tokens(40)) <= 20
    assert any("values from 400 are below the workload's longest request" in n for n in job.search_space().notes)


def test_request_tokens_are_the_runs_own_requests() -> None:
    from tuner.load import UniformLength, Workload

    w = Workload(input_len=UniformLength(low=10, high=500), output_len=UniformLength(low=1, high=50), seed=4)
    sent = [spec.prompt_len + spec.output_len for spec, _ in zip(w.prompts(), range(30), strict=False)]
    assert w.request_tokens(30) == sent


@pytest.mark.parametrize("kind", ["docker", "process"])
def test_a_launcher_option_the_launcher_does_not_take_is_named_before_any_launch(tmp_path: Path, kind: str) -> None:
    target = f"target: {{launcher: {kind}, model: llama-3.1-8b, gpu: l4, {kind}: {{options: {{stop_grace: 5}}}}}}"
    text = GOOD.replace(GOOD.splitlines()[2], target)
    message = error_of(tmp_path, text)
    assert message.count("\n") == 0
    assert f"target.{kind}.options.stop_grace: not an option of the {kind} launcher; allowed: " in message
    assert message.endswith("did you mean stop_grace_s?")
    good = text.replace("stop_grace: 5", "stop_grace_s: 5")
    assert getattr(load_job(write(tmp_path, good, "good.yaml")).target, kind).options == {"stop_grace_s": 5}


def test_schema_shows_the_constraints_the_loader_applies() -> None:
    defs = job_schema()["$defs"]
    assert {"minimum": 1}.items() <= defs["WorkloadSection"]["properties"]["input_len"]["anyOf"][0].items()
    assert defs["Choices"]["properties"]["choices"]["minItems"] == 1
    assert defs["Range"]["properties"]["step"]["anyOf"][0]["exclusiveMinimum"] == 0


def test_recorded_vllm_arguments_are_the_pinned_versions_and_know_switches() -> None:
    from tuner.vllm_args import vllm_args
    from tuner.vllm_pin import PINNED_VLLM

    args = vllm_args(PINNED_VLLM)
    assert args["max_num_seqs"].kind == "int" and args["enable_prefix_caching"].kind == "switch"
    assert {"max_model_len", "gpu_memory_utilization", "max_num_batched_tokens", "kv_cache_dtype"} <= set(args)
    assert "max_num_sequences" not in args


def test_shipped_job_files_pass_the_vllm_flag_check() -> None:
    from tuner.vllm_args import vllm_args

    for f in sorted((Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml")):
        assert set(load_job(f).space) <= set(vllm_args()), f


def test_a_stored_job_keeps_a_flag_the_pinned_vllm_no_longer_has() -> None:
    """A study run with an older vLLM (swap_space is gone from 0.32's arguments) stays readable by the commands that
    act on its trials: the flag reaches the server as it did in the study, not a refusal."""
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "search_spaces" / "emulator-demo.yaml").read_text())
    data["space"]["swap_space"] = 4
    with pytest.raises(ConfigError, match=r"space\.swap_space: not an argument of vLLM"):
        parse_job(data, where="job.yaml")
    job = parse_job(data, where="stored job", stored=True)
    flags = job.search_space().suggest(optuna.trial.FixedTrial(_baseline_params(job))).flags
    assert flags.extra["swap_space"] == 4


def _baseline_params(job: Job) -> dict[str, object]:
    space = job.search_space()
    return {name: (d.choices[0] if hasattr(d, "choices") else d.low) for name, d in space.distributions.items()}


def test_goodput_objective_bounds_each_request_by_the_latency_slos(tmp_path: Path) -> None:
    text = GOOD.replace("slos: [", "objective: goodput\nslos: [")
    job = load_job(write(tmp_path, text))
    # The share of good requests a step must reach is the success_rate SLO's; 0.99 where the job gives none.
    assert (job.goodput_slo().metric, job.goodput_slo().threshold) == ("good_share", 0.99)
    job = load_job(write(tmp_path, text.replace('"success_rate >= 0.99"', '"success_rate >= 95%"')))
    assert job.goodput_slo().threshold == pytest.approx(0.95)
    job = load_job(write(tmp_path, text.replace(', "success_rate >= 0.99"', "")))
    assert job.goodput_slo().threshold == 0.99


@pytest.mark.parametrize("slos", ['["success_rate >= 0.99"]', '["output_throughput >= 100", "e2e_p95 >= 1s"]'])
def test_goodput_objective_without_a_latency_bound_is_one_line(tmp_path: Path, slos: str) -> None:
    text = GOOD.replace('slos: ["e2e_p95 <= 20s", "success_rate >= 0.99"]', f"objective: goodput\nslos: {slos}")
    message = error_of(tmp_path, text)
    assert "job.yaml: objective: goodput needs a latency SLO to judge each request by" in message
    assert len(message.splitlines()) == 1 and "e.g. 'ttft_p95 <= 2s'" in message
