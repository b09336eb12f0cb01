"""Each latency SLO gets its rule on the vLLM histogram the registry names, at the SLO's own quantile."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tuner.ship.alerts import alert_rules, rules_file

JOB = 'job="vllm",instance="a"'
SLOS = ["tpot_p95 <= 100ms", "ttft_p99 <= 2s", "ttft_p90 <= 1s", "itl_p50 <= 50ms", "e2e_mean <= 8s", "e2e_max <= 30s"]
RULES = alert_rules(SLOS, queue_at_capacity=8)
BY_NAME = {r["alert"]: r for r in RULES}


def test_each_latency_slo_asks_its_own_histogram_at_its_own_quantile() -> None:
    tpot = BY_NAME["VllmSloTpotP95"]["expr"]
    assert tpot.startswith("histogram_quantile(0.95, ") and "vllm:request_time_per_output_token_seconds_bucket" in tpot
    assert tpot.endswith("> 0.1")
    assert BY_NAME["VllmSloTtftP99"]["expr"].startswith("histogram_quantile(0.99, sum by (le) (rate(vllm:time_to")
    assert BY_NAME["VllmSloTtftP90"]["expr"].startswith("histogram_quantile(0.9, ")
    assert "vllm:inter_token_latency_seconds_bucket" in BY_NAME["VllmSloItlP50"]["expr"]
    mean = BY_NAME["VllmSloE2EMean"]["expr"]
    assert "vllm:e2e_request_latency_seconds_sum" in mean and "vllm:e2e_request_latency_seconds_count" in mean
    assert BY_NAME["VllmSloTtftP99"]["annotations"]["summary"].startswith("TTFT P99 is over the SLO ttft_p99<=2s")
    # A histogram has no maximum: no rule rather than a wrong one.
    assert not any("Max" in name for name in BY_NAME)


def test_the_rules_check_and_a_slow_decode_fires_only_the_tpot_rule(promtool: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(rules_file(RULES))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(RULES)} rules found" in done.stdout

    def histogram(name: str, le: str) -> list[dict[str, str]]:
        """60 requests a minute, every one in the bucket `le` (the cumulative buckets above it too)."""
        bounds = ["0.05", "0.1", "0.5", "1", "2", "10", "+Inf"]
        return [
            {"series": f'{name}_bucket{{{JOB},le="{b}"}}', "values": f"0+{60 if float(b) >= float(le) else 0}x20"}
            for b in bounds
        ]

    slow_decode = [
        *histogram("vllm:request_time_per_output_token_seconds", "0.5"),
        *histogram("vllm:time_to_first_token_seconds", "0.5"),
        *histogram("vllm:inter_token_latency_seconds", "0.05"),
    ]
    latency_alerts = [name for name in BY_NAME if name.startswith("VllmSlo")]
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": slow_decode,
                "alert_rule_test": [
                    {
                        "eval_time": "15m",
                        "alertname": name,
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": BY_NAME[name]["annotations"],
                            }
                        ]
                        if name == "VllmSloTpotP95"
                        else [],
                    }
                    for name in latency_alerts
                ],
            }
        ],
    }
    spec = tmp_path / "rules_test.yaml"
    spec.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("slo", ["ttft_p95 >= 1s", "success_rate >= 0.99"])
def test_a_lower_bound_or_a_rate_gets_no_latency_rule(slo: str) -> None:
    assert not [r for r in alert_rules([slo], queue_at_capacity=1) if r["alert"].startswith("VllmSlo")]
