"""`tuner plan --compare-gpus` on the emulator study: catalog cards sized for a rate by the twin, no server started."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.errors import ConfigError
from tuner.ship.cards import parse_cards, parse_prices

pytestmark = pytest.mark.slow

CARDS = "h100-80gb,a100-80gb,l40s"
PRICES = "a100-80gb=2.2,l40s=1.2"  # test figures, not anyone's price list


def compare(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The study read from its storage by name (its stored job), as a user who has no job file at hand runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_STORAGE_URL", "TUNER_STORAGE")}
    where = ["emulator-demo-max-rate", "--storage", f"sqlite:///{job.with_suffix('.db')}"]
    return subprocess.run(
        [sys.executable, "-m", "tuner", "plan", *where, "--rate", "40", *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "80"},
    )


def test_cards_are_ranked_by_cost_with_the_arithmetic_kept(max_rate_job: Path) -> None:
    # The study's own card (h100-80gb) is priced by --price-per-gpu-hour, the others by --gpu-hour-usd.
    done = compare(
        max_rate_job, "--compare-gpus", CARDS, "--gpu-hour-usd", PRICES, "--price-per-gpu-hour", "3.5", "--json"
    )
    assert done.returncode == 0, done.stderr
    plans = json.loads(done.stdout)
    assert sorted(p["card"] for p in plans) == sorted(CARDS.split(","))
    for p in plans:
        assert p["predicted"] is True and p["flags"] is not None
        assert p["servers"] == math.ceil(40 / (p["capacity_rps"] * 0.7))
        assert p["gpus"] == p["servers"] * p["world_size"]
        assert p["usd_per_hour"] == pytest.approx(p["gpus"] * p["gpu_hour_usd"])
        tokens = p["tokens_per_request"]
        assert p["usd_per_m_tokens"] == pytest.approx(p["usd_per_hour"] / (40 * tokens * 3600 / 1e6))
    costs = [p["usd_per_hour"] for p in plans]
    assert costs == sorted(costs)
    by_card = {p["card"]: p for p in plans}
    assert by_card["h100-80gb"]["gpu_hour_usd"] == 3.5
    assert by_card["h100-80gb"]["price_source"] == "--price-per-gpu-hour"
    assert by_card["l40s"]["price_source"] == "--gpu-hour-usd"
    # The twin runs each card's datasheet: HBM3 at 3.35 TB/s serves more than the L40S's 0.86 TB/s GDDR6.
    assert by_card["h100-80gb"]["capacity_rps"] > by_card["l40s"]["capacity_rps"]


def test_without_prices_given_the_catalogs_defaults_rank_the_cards_and_are_named(max_rate_job: Path) -> None:
    from tuner.catalog import GPUS

    done = compare(max_rate_job, "--compare-gpus", CARDS, "--json")
    assert done.returncode == 0, done.stderr
    plans = json.loads(done.stdout)
    for p in plans:
        assert p["gpu_hour_usd"] == GPUS[p["card"]].usd_per_hour
        assert p["price_source"].startswith("Runpod Serverless") and "read 2026-12-05" in p["price_source"]
    costs = [p["usd_per_hour"] for p in plans]
    assert costs == sorted(costs)


def test_the_table_is_marked_as_predictions_and_reads_in_80_columns(max_rate_job: Path) -> None:
    cards = "h100-80gb,l40s,a10g"  # AWS's A10G has no catalog price: the cards cannot all be priced
    done = compare(max_rate_job, "--compare-gpus", cards)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert lines[0].startswith("PREDICTED by the twin")
    rows = [line.split() for line in lines if line[:4].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"] and {r[1] for r in rows} == set(cards.split(","))
    gpus = [int(r[6]) for r in rows]
    assert gpus == sorted(gpus)  # not every card priced: ranked by GPUs needed, and it says so
    text = " ".join(done.stdout.split())
    assert "ranked by GPUs needed" in text and "--gpu-hour-usd" in text
    assert f"confirm {rows[0][1]} on the real card" in text and "tuner tune" in text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--compare-gpus", "h100-80gb,h9000"), "allowed: "),
        (("--compare-gpus", "l40s", "--gpu-hour-usd", "l40s=free"), "--gpu-hour-usd"),
        (("--compare-gpus", "l40s", "--manifest", "m.yaml"), "--manifest"),
        (("--gpu-hour-usd", "l40s=1.2"), "--compare-gpus"),
    ],
)
def test_bad_input_is_one_line_exit_2(max_rate_job: Path, args: tuple[str, ...], says: str) -> None:
    done = compare(max_rate_job, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_unknown_card_line_lists_the_catalog() -> None:
    with pytest.raises(ConfigError) as e:
        parse_cards("h100-80gb, H9000")
    assert "h9000" in str(e.value) and "l40s" in str(e.value) and "cpu" not in str(e.value).split("allowed: ")[1]
    assert parse_cards(" H100-80GB ,l40s,l40s") == ["h100-80gb", "l40s"]
    assert parse_prices("h100-80gb=3.5, l40s=1.2") == {"h100-80gb": 3.5, "l40s": 1.2}
    for bad in ("h100-80gb", "h100-80gb=-1", "nope=2"):
        with pytest.raises(ConfigError, match="--gpu-hour-usd"):
            parse_prices(bad)
