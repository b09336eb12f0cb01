"""The alert rules through promtool: the file checks, and synthetic series fire exactly the rules they should."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tuner.ship.alerts import alert_rules, prometheus_rule, rules_file

SLOS = ["e2e_p95 <= 10s", "ttft_p95 <= 2s", "success_rate >= 0.99"]
RULES = alert_rules(SLOS, queue_at_capacity=8)
JOB = 'job="vllm",instance="a"'


def annotations(alert: str) -> dict[str, str]:
    return next(dict(r["annotations"]) for r in RULES if r["alert"] == alert)


def histogram(name: str, le_counts: dict[str, int]) -> list[dict[str, str]]:
    """A latency histogram whose requests all land in the buckets given, `count` a minute each, cumulative."""
    out, total = [], 0
    for le in ("1", "2", "5", "10", "20", "+Inf"):
        total += le_counts.get(le, 0)
        out.append({"series": f'{name}{{{JOB},le="{le}"}}', "values": f"0+{total}x20"})
    return out


def case(series: list[dict[str, str]], fired: dict[str, dict[str, str]], quiet: list[str]) -> dict[str, Any]:
    """One promtool test: these series, the alerts in `fired` firing at 15m with those extra labels, `quiet` not."""
    expect = [
        {
            "eval_time": "15m",
            "alertname": name,
            "exp_alerts": [
                {"exp_labels": {"severity": _severity(name), **labels}, "exp_annotations": annotations(name)}
            ],
        }
        for name, labels in fired.items()
    ]
    expect += [{"eval_time": "15m", "alertname": name, "exp_alerts": []} for name in quiet]
    return {"interval": "1m", "input_series": series, "alert_rule_test": expect}


def _severity(alert: str) -> str:
    return str(next(r["labels"]["severity"] for r in RULES if r["alert"] == alert))


OVERLOADED = [
    *histogram("vllm:e2e_request_latency_seconds_bucket", {"20": 60}),
    *histogram("vllm:time_to_first_token_seconds_bucket", {"5": 60}),
    {"series": f'vllm:request_success_total{{{JOB},finished_reason="stop"}}', "values": "0+50x20"},
    {"series": f'vllm:request_success_total{{{JOB},finished_reason="abort"}}', "values": "0+10x20"},
    {"series": f"vllm:num_requests_waiting{{{JOB}}}", "values": "30x20"},
    {"series": f"vllm:kv_cache_usage_perc{{{JOB}}}", "values": "0.97x20"},
    {"series": f"vllm:num_preemptions_total{{{JOB}}}", "values": "0+3x20"},
    {"series": f"up{{{JOB}}}", "values": "0x20"},
]
HEALTHY = [
    *histogram("vllm:e2e_request_latency_seconds_bucket", {"1": 55, "5": 5}),
    *histogram("vllm:time_to_first_token_seconds_bucket", {"1": 60}),
    {"series": f'vllm:request_success_total{{{JOB},finished_reason="stop"}}', "values": "0+1000x20"},
    {"series": f'vllm:request_success_total{{{JOB},finished_reason="abort"}}', "values": "0+1x20"},
    {"series": f"vllm:num_requests_waiting{{{JOB}}}", "values": "8x20"},  # what the winner held at capacity
    {"series": f"vllm:kv_cache_usage_perc{{{JOB}}}", "values": "0.85x20"},
    {"series": f"vllm:num_preemptions_total{{{JOB}}}", "values": "4x20"},  # preempted once, long ago
    {"series": f"up{{{JOB}}}", "values": "1x20"},
]
ALL = [r["alert"] for r in RULES]


@pytest.fixture
def rules_path(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(rules_file(RULES))
    return path


def test_the_rules_file_checks(promtool: str, rules_path: Path) -> None:
    done = subprocess.run([promtool, "check", "rules", str(rules_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(RULES)} rules found" in done.stdout


def test_every_rule_says_what_it_means_and_what_to_do() -> None:
    assert set(ALL) == {
        "VllmSloE2EP95",
        "VllmSloTtftP95",
        "VllmErrorRate",
        "VllmQueueAboveCapacity",
        "VllmKvCacheFull",
        "VllmPreemptions",
        "VllmDown",
    }
    assert all(r["annotations"]["summary"] and r["annotations"]["action"] for r in RULES)
    assert next(r for r in RULES if r["alert"] == "VllmQueueAboveCapacity")["expr"].endswith("> 8")


def test_synthetic_series_fire_and_stay_quiet_as_intended(promtool: str, rules_path: Path, tmp_path: Path) -> None:
    fired = {name: {} for name in ALL if name != "VllmDown"} | {"VllmDown": {"job": "vllm", "instance": "a"}}
    tests = {
        "rule_files": [str(rules_path)],
        "evaluation_interval": "1m",
        "tests": [case(OVERLOADED, fired, []), case(HEALTHY, {}, ALL)],
    }
    spec = tmp_path / "rules_test.yaml"
    spec.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_prometheus_rule_holds_the_same_groups() -> None:
    doc = prometheus_rule(RULES, name="llm")
    assert doc["kind"] == "PrometheusRule" and doc["metadata"]["name"] == "llm-alerts"
    assert doc["spec"] == yaml.safe_load(rules_file(RULES))
