"""The cost objective (tuner.cost): each shape's capacity within the SLOs, the replicas the job's load needs, what
they cost; the cheapest chosen and shown; the bad inputs said in a line; the front of box tok/s against $."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import FixedTrial
from study_fakes import JOB, FakeLauncher, FakeServer, job

from tuner.config import Job
from tuner.cost import JobLoad, cost_figures, tokens_per_request
from tuner.emulator import Emulator
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.study import Measurement, Objective, measure_load
from tuner.study.verdict import DIRECTIONS

# -- the arithmetic on known numbers ---------------------------------------------------------------------------------


def test_an_open_loop_load_needs_whole_replicas_and_pays_for_their_gpus() -> None:
    # A TP-2 replica meets the SLOs up to 4 req/s, each request 100 output tokens; the job sends 10.
    c = cost_figures(4.0, 100.0, world_size=2, load=JobLoad(rate=10.0), gpu_hour_usd=2.0)
    assert c is not None
    assert (c.replicas, c.gpus) == (3, 6)  # 2.5 replicas' worth: 3 whole ones
    assert c.load_rate == 10.0 and c.load_tok_s == pytest.approx(1000.0) and c.box_tok_s == pytest.approx(1200.0)
    assert c.usd_per_hour == pytest.approx(12.0)
    # $12 an hour for 1000 x 3600 = 3.6M tokens: $3.33 a million; 6 GPU-hours for 3.6M tokens: 1.67 a million.
    assert c.usd_per_m_tokens == pytest.approx(12 / 3.6)
    assert c.gpu_hours_per_m_tokens == pytest.approx(6 / 3.6)
    assert c.value == pytest.approx(3.6 / 12)  # what the study maximises: million tokens per $


def test_a_load_of_exactly_whole_replicas_takes_no_extra_one_and_no_price_scores_gpu_hours() -> None:
    c = cost_figures(4.0, 100.0, world_size=1, load=JobLoad(rate=8.0))
    assert c is not None and c.replicas == 2 and c.gpus == 2
    assert c.usd_per_hour is None and c.usd_per_m_tokens is None
    assert c.gpu_hours_per_m_tokens == pytest.approx(2 / (800 * 3600) * 1e6)
    assert c.value == pytest.approx(1 / c.gpu_hours_per_m_tokens)
    # a light load still needs one replica
    light = cost_figures(4.0, 100.0, world_size=4, load=JobLoad(rate=0.5))
    assert light is not None and (light.replicas, light.gpus) == (1, 4)


def test_users_are_sized_by_littles_law() -> None:
    # At its capacity of 2 req/s (100 tokens a request) a replica held 4 requests in flight: it serves 4 users;
    # 20 users need 5 replicas, and send 20 x 2 / 4 = 10 req/s.
    c = cost_figures(2.0, 100.0, world_size=1, load=JobLoad(users=20), in_flight=4.0, gpu_hour_usd=1.0)
    assert c is not None and c.replicas == 5 and c.load_rate == pytest.approx(10.0)
    assert c.usd_per_m_tokens == pytest.approx(5 / (1000 * 3600) * 1e6)


def test_no_capacity_or_no_in_flight_figure_has_no_cost() -> None:
    assert cost_figures(0.0, 0.0, world_size=1, load=JobLoad(rate=1.0)) is None
    assert cost_figures(2.0, 100.0, world_size=1, load=JobLoad(users=4), in_flight=None) is None
    with pytest.raises(ValueError, match="exactly one"):
        JobLoad(rate=1.0, users=2)


# -- bad input ---------------------------------------------------------------------------------------------------------


def _cost_job(tmp_path: Path, **changes: Any) -> Path:
    data = {**JOB, "objective": "cost", **changes}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"slos": []}, "objective: cost finds each shape's capacity within the SLOs; slos is empty"),
        (
            {"arrival": {"concurrency": 4, "requests": 8}, "workload": {"conversations": {"turns": 2}}},
            "objective cost searches a request rate; use objective: throughput",
        ),
        ({"objective": "cheap"}, "'throughput', 'max_rate', 'goodput' or 'cost'"),
    ],
)
def test_a_cost_job_that_cannot_be_served_is_one_line_and_exit_2(
    tmp_path: Path, changes: dict[str, Any], expected: str
) -> None:
    path = _cost_job(tmp_path, **changes)
    command = [sys.executable, "-m", "tuner", "tune", "--dry-run", str(path)]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 2, out.stdout
    assert expected in " ".join(out.stderr.split()) and "Traceback" not in out.stderr


def test_a_trace_is_not_a_load_the_cost_objective_can_size(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "input_len": 16, "output_len": 4}\n{"t": 1, "input_len": 16, "output_len": 4}\n')
    path = _cost_job(tmp_path, arrival={"trace": str(trace)})
    command = [sys.executable, "-m", "tuner", "tune", "--dry-run", str(path)]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "objective: cost serves the job's load, given as arrival.rate" in " ".join(out.stderr.split())


# -- a cost study on the emulator ------------------------------------------------------------------------------------

LOAD_RATE = 12.0


def _emulated(seen: list[tuple[VllmFlags, Measurement]]) -> Any:
    """The load phase against an in-process emulator of the trial's shape (an L4, 50 times faster)."""

    async def measure(_server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        args = [
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "l4",
            "--max-model-len",
            "4096",
            "--time-scale",
            "50",
            "--seed",
            "1",
        ]
        args += ["--tensor-parallel-size", str(flags.tensor_parallel_size), "--max-num-seqs", str(flags.max_num_seqs)]
        emu = Emulator.from_args(args, log_stream=io.StringIO())
        async with emu.serve_http(host="127.0.0.1", port=0) as base:
            server = FakeServer(base_url=base, model="llama-3.1-8b", facts=StartupFacts(), time_scale=50)
            m = await measure_load(server, j, flags)  # type: ignore[arg-type]
        seen.append((flags, m))
        return m

    return measure


def cost_job(**changes: Any) -> Job:
    data: dict[str, Any] = {
        "objective": "cost",
        "target": {**JOB["target"], "gpus": 2, "gpu_hour_usd": 0.8},
        "space": {
            "tensor_parallel_size": {"choices": [1, 2]},
            "max_num_seqs": {"choices": [2, 32]},
            "gpu_memory_utilization": 0.9,
            "max_model_len": 4096,
        },
        "arrival": {"rate": LOAD_RATE, "requests": 8},
        "capacity_search": {"requests_per_step": 16, "max_steps": 3},
        "slos": ["e2e_p95 <= 4s", "success_rate >= 0.9"],
    }
    return job(**(data | changes))


def test_a_trial_is_scored_by_what_its_replicas_for_the_load_cost() -> None:
    seen: list[tuple[VllmFlags, Measurement]] = []
    trial = FixedTrial({"tensor_parallel_size": 2, "max_num_seqs": 32})
    values = Objective(cost_job(), FakeLauncher(), measure=_emulated(seen))(trial)
    ((_, m),) = seen
    a = trial.user_attrs
    assert m.rate is not None and m.rate > 0 and a["request_rate"] == m.rate  # one replica's capacity
    assert m.result is not None
    tokens = tokens_per_request(m.result.summary)
    assert tokens == pytest.approx(32)  # the workload's output_len, whatever the step's tok/s
    expected = cost_figures(m.rate, tokens, world_size=2, load=JobLoad(rate=LOAD_RATE), gpu_hour_usd=0.8)
    assert expected is not None
    assert a["replicas"] == expected.replicas and a["box_gpus"] == 2 * expected.replicas
    assert a["box_output_tok_s"] == pytest.approx(expected.replicas * m.rate * 32)  # at capacity, whole requests
    assert a["cost_load_rate"] == LOAD_RATE
    assert a["cost_usd_per_hour"] == pytest.approx(0.8 * a["box_gpus"])
    assert a["cost_usd_per_m_tokens"] == pytest.approx(expected.usd_per_m_tokens)
    assert values[0] == pytest.approx(1 / a["cost_usd_per_m_tokens"])


@pytest.fixture(scope="module")
def cost_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Every shape and batch of `cost_job` measured on the emulator, in a SQLite study as `tuner tune` writes it."""
    from tuner.study.storage import study_attrs

    j = cost_job()
    url = f"sqlite:///{tmp_path_factory.mktemp('cost') / 'cost.db'}"
    grid = optuna.samplers.GridSampler(j.search_space().grid(), seed=0)
    study = optuna.create_study(storage=url, study_name="cost", directions=DIRECTIONS, sampler=grid)
    for k, v in study_attrs(j).items():
        study.set_user_attr(k, v)
    study.optimize(Objective(j, FakeLauncher(), measure=_emulated([])), n_trials=4)
    return url, "cost"


def _cli(*args: str) -> str:
    from typer.testing import CliRunner

    from tuner.cli import app

    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    return r.output


def test_the_cheapest_configuration_is_chosen_and_shown(cost_study: tuple[str, str]) -> None:
    from tuner.report import choose, pareto_front, study_view

    url, name = cost_study
    view = study_view(optuna.load_study(study_name=name, storage=url))
    costed = [t for t in view.trials if t.feasible and t.cost_usd_per_m_tokens is not None]
    assert len(costed) >= 2, [t.verdict for t in view.trials]
    cheapest = min(costed, key=lambda t: t.cost_usd_per_m_tokens or 0.0)
    winner = choose(pareto_front(view.trials), "throughput")
    assert winner.cost_usd_per_m_tokens == pytest.approx(cheapest.cost_usd_per_m_tokens)
    trials = _cli("trials", name, "--storage", url)
    assert "$/M tok" in trials and "GPUs" in trials and "tok/s" not in trials.split("\n\n")[0].splitlines()[2]
    assert cheapest.cost_text in trials
    pareto = _cli("pareto", name, "--storage", url, "--no-plot")
    assert "$/M tok" in pareto and "× cost" in pareto and f"--trial {winner.number}" in pareto
    shown = _cli("show", name, str(winner.number), "--storage", url)
    assert f"cost: the job's {LOAD_RATE:,.2f} req/s need {winner.replicas} x" in " ".join(shown.split())
    for text in (trials, pareto):
        assert all(len(line) <= 80 for line in text.splitlines()), text


# -- tuner pareto --cost --------------------------------------------------------------------------------------------


def _view(number: int, box_tok_s: float, usd: float | None, *, feasible: bool = True) -> Any:
    from tuner.report.views import TrialView

    return TrialView(
        number=number,
        state="COMPLETE",
        baseline=False,
        outcome="measured",
        reason=None,
        flags={},
        throughput=box_tok_s,
        objective_latency_s=1.0,
        feasible=feasible,
        replicas=2,
        box_gpus=4,
        usd_per_m_tokens=usd,
    )


def test_the_cost_front_keeps_what_no_trial_beats_on_both_cheapest_first() -> None:
    from tuner.report.cost_front import cost_front

    trials = [
        _view(0, 1000.0, 2.0),
        _view(1, 1500.0, 3.0),  # more tok/s, dearer: on the front
        _view(2, 900.0, 2.5),  # beaten by #0 on both
        _view(3, 2000.0, 1.0, feasible=False),  # missed an SLO: not a point
        _view(4, 5000.0, None),  # no price: not a point
        _view(5, 1000.0, 2.0),  # ties #0: neither beats the other
    ]
    assert [t.number for t in cost_front(trials)] == [0, 5, 1]


def test_pareto_cost_shows_the_front_of_box_throughput_against_dollars(cost_study: tuple[str, str]) -> None:
    import json

    from tuner.report import study_view
    from tuner.report.cost_front import box_tok_s, cost_front

    url, name = cost_study
    front = cost_front(study_view(optuna.load_study(study_name=name, storage=url)).trials)
    assert front and all(t.usd_per_m_tokens is not None for t in front)
    out = _cli("pareto", name, "--storage", url, "--cost")
    assert "box tok/s" in out and "$/M tok" in out and "box output tok/s" in out  # the table and its plot
    assert all(len(line) <= 80 for line in out.splitlines()), out
    for t in front:
        assert f"${t.usd_per_m_tokens:,.3f}" in out and f"{box_tok_s(t):,.1f}" in out
    doc = json.loads(_cli("pareto", name, "--storage", url, "--cost", "--json"))
    assert [p["number"] for p in doc["front"]] == [t.number for t in front]


def test_pareto_cost_draws_its_front_to_html_and_png(cost_study: tuple[str, str], tmp_path: Path) -> None:
    url, name = cost_study
    html, png = tmp_path / "cost.html", tmp_path / "cost.png"
    _cli("pareto", name, "--storage", url, "--cost", "--no-plot", "--html", str(html), "--png", str(png))
    page = html.read_text()
    # Plotly writes the labels JSON-escaped ("/" as \u002f)
    assert "per million output tokens" in page and "box output tok\\u002fs" in page and '"name":"front"' in page
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pareto_cost_without_a_price_is_one_line_and_exit_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'free.db'}"
    study = optuna.create_study(storage=url, study_name="free", directions=DIRECTIONS)
    study.add_trial(
        optuna.trial.create_trial(
            values=[100.0, 1.0],
            user_attrs={"outcome": "measured", "flags": {}, "feasible": True, "output_tok_s": 100.0},
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "tuner", "pareto", "free", "--storage", url, "--cost"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "study 'free' has no GPU-hour price" in " ".join(out.stderr.split())


# -- the twin ------------------------------------------------------------------------------------------------------


def test_the_twin_ranks_shapes_by_the_cost_of_the_load_and_twin_first_search_starts_there() -> None:
    from tuner.study.samplers import make_sampler, sampler_name
    from tuner.twin.cost import CostScore, capacity_simulate
    from tuner.twin.model import Twin, candidates
    from tuner.twin.simulate import simulate

    j = cost_job(sampler={"seed": 0})
    assert sampler_name(j) == "twin"  # the twin can imitate a cost job: twin-first by default
    pool = candidates(j.search_space(), 400, 0)
    simulated = capacity_simulate(simulate)
    twin = Twin(j, pool, simulated)
    twin.sweep()
    score = CostScore(j, lambda: twin, simulated)
    predicted = {c.key: twin.predict(c.key) for c in pool}
    cheapest = max(pool, key=lambda c: score.expected(predicted[c.key]))
    fastest = max(pool, key=lambda c: predicted[c.key].output_tok_s)
    # Two TP-2 GPUs give one replica more tok/s than one TP-1 GPU, but not twice as much: the cost ranking differs.
    assert cheapest.key != fastest.key and fastest.flags.tensor_parallel_size == 2
    point = twin.point(cheapest.key).summary(j)
    assert point is not None and point.request_throughput > 0  # each shape simulated at its capacity
    events: list[str] = []
    sampler = make_sampler(j, j.search_space(), on_event=events.append)
    study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
    study.optimize(Objective(j, FakeLauncher(), measure=_emulated([])), n_trials=1)
    (first,) = study.trials
    cheapest_cost = 1 / score.optimistic(predicted[cheapest.key])
    assert any(f"the best at {cheapest_cost:,.2f} $ per million output tokens" in e for e in events), events
    assert first.params == dict(cheapest.params)
    assert first.user_attrs["twin_predicted_tok_s"] == pytest.approx(predicted[cheapest.key].output_tok_s, abs=0.1)


# -- users, re-scoring, the export's provenance ------------------------------------------------------------------------


def test_a_closed_loop_job_is_sized_by_the_users_each_replica_held_in_flight() -> None:
    seen: list[tuple[VllmFlags, Measurement]] = []
    j = cost_job(arrival={"concurrency": 40, "requests": 8})
    trial = FixedTrial({"tensor_parallel_size": 1, "max_num_seqs": 32})
    values = Objective(j, FakeLauncher(), measure=_emulated(seen))(trial)
    ((_, m),) = seen
    assert m.result is not None and m.rate
    in_flight = m.result.summary.concurrency
    a = trial.user_attrs
    assert a["replicas"] - 1 < 40 / in_flight <= a["replicas"]  # whole replicas, the fewest that hold 40 users
    assert a["cost_load_rate"] == pytest.approx(40 * m.rate / in_flight)
    assert values[0] == pytest.approx(1 / a["cost_usd_per_m_tokens"])


def test_rescoring_a_cost_trial_costs_it_again_at_its_new_capacity() -> None:
    from dataclasses import replace

    from tuner.report.rescore import recosted

    t = replace(
        _view(0, 1.0, 1.0),
        flags={"tensor_parallel_size": 2},
        output_tok_s=400.0,
        request_rate=4.0,
        cost_usd_per_hour=12.0,  # 3 replicas x 2 GPUs at $2
        box_gpus=6,
        replicas=3,
        cost_gpu_hours_per_m_tokens=1.0,
    )
    # under a tighter SLO the replica met it only at 2 req/s (200 tok/s): 5 replicas of 2 GPUs for 10 req/s
    after = recosted(replace(t, output_tok_s=200.0, request_rate=2.0), JobLoad(rate=10.0), True, None, 100.0)
    assert (after.replicas, after.box_gpus) == (5, 10)
    assert after.cost_usd_per_hour == pytest.approx(20.0)
    assert after.cost_usd_per_m_tokens == pytest.approx(20 / 3.6) and after.throughput == pytest.approx(3.6 / 20)
    missed = recosted(t, JobLoad(rate=10.0), False, None, 100.0)
    assert missed.throughput == 0.0 and not missed.costed and missed.cost_text == "—"


def test_the_export_names_the_cost_in_its_provenance(cost_study: tuple[str, str]) -> None:
    from tuner.report import choose, pareto_front, provenance, study_view

    url, name = cost_study
    view = study_view(optuna.load_study(study_name=name, storage=url))
    winner = choose(pareto_front(view.trials), "throughput")
    p = provenance(view, winner)
    assert p.output_tok_s == winner.output_tok_s  # one replica's measured tok/s, not the tokens per $
    each = (winner.box_gpus or 0) // (winner.replicas or 1)
    note = next(n for n in p.notes if n.startswith("cost objective:"))
    assert (
        f"{winner.replicas} replica" in note and f"x {each} GPU" in note and f"{winner.cost_text} per million" in note
    )
    assert any(line == f"note: {note}" for line in p.comment_lines())


def test_status_and_studies_name_the_cheapest_by_its_cost(cost_study: tuple[str, str]) -> None:
    from tuner.report import choose, pareto_front, study_view

    url, name = cost_study
    winner = choose(pareto_front(study_view(optuna.load_study(study_name=name, storage=url)).trials), "throughput")
    status = " ".join(_cli("status", name, "--storage", url).split())
    assert f"best so far: trial {winner.number}: {winner.cost_text} per M output tokens" in status
    studies = _cli("studies", "--storage", url)
    assert f"{winner.cost_text}/M (#{winner.number})" in studies and "best tok/s or $" in studies


def test_the_dry_run_says_what_a_cost_study_minimises_and_the_load_it_sizes_for() -> None:
    from tuner.cli.cost_lines import cost_box_text, directions_text

    assert directions_text(cost_job()) == (
        "objective: cost; directions: minimize the cost of the job's load (maximize million output tokens per $), "
        "minimize e2e_p95"
    )
    assert cost_box_text(cost_job()) == (
        "cost: each shape's capacity within the SLOs, then ceil(load / capacity) replicas for 12 req/s; a shape may "
        "span at most 2 GPUs (target.gpus); $0.8 a GPU-hour"
    )
    # The L4 has a catalog price, with its source and the day it was read; the A10G (AWS's alone) has none.
    listed = cost_job(target={**JOB["target"], "gpus": 2})
    assert cost_box_text(listed).endswith(
        "$0.468 a GPU-hour, the catalog's default (Runpod Serverless, an always-on worker's list price "
        "(docs.runpod.io/serverless/pricing, read 2026-12-05); target.gpu_hour_usd for yours)"
    )
    unpriced = cost_job(target={**JOB["target"], "gpu": "a10g", "gpus": 2}, arrival={"concurrency": 40, "requests": 8})
    assert "per GPU-hour" in directions_text(unpriced)
    assert "for 40 users (sized by Little's law" in cost_box_text(unpriced)
    assert "no price (target.gpu_hour_usd): scored in GPU-hours" in cost_box_text(unpriced)


def test_a_shape_that_meets_the_slos_at_no_rate_has_no_cost_and_no_box() -> None:
    trial = FixedTrial({"tensor_parallel_size": 1, "max_num_seqs": 2})
    values = Objective(cost_job(slos=["e2e_p95 <= 1ms"]), FakeLauncher(), measure=_emulated([]))(trial)
    a = trial.user_attrs
    assert a["outcome"] == "measured" and a["feasible"] is False and values[0] == 0.0
    assert "replicas" not in a or a["replicas"] is None
    assert "cost_usd_per_m_tokens" not in a and "cost_gpu_hours_per_m_tokens" not in a


def test_the_run_names_the_cheapest_in_a_line_the_progress_bar_holds(cost_study: tuple[str, str]) -> None:
    from tuner.cli.trial_lines import best_text, trial_line
    from tuner.record import TrialRecord

    url, name = cost_study
    study = optuna.load_study(study_name=name, storage=url)
    costed = [t for t in study.trials if TrialRecord.from_attrs(t.user_attrs).cost_usd_per_m_tokens is not None]
    cheapest = min(costed, key=lambda t: t.user_attrs["cost_usd_per_m_tokens"])
    a = cheapest.user_attrs
    each = a["box_gpus"] // a["replicas"]
    assert (
        best_text(study)
        == f"cheapest: #{cheapest.number} ${a['cost_usd_per_m_tokens']:,.2f}/M tok, {a['replicas']}×{each} GPUs"
    )
    assert f"{a['replicas']}×{each} GPUs for {LOAD_RATE:.2f} req/s: $" in trial_line(cheapest)
