"""The conformance fixtures against real vLLM itself: re-recorded from the pinned CPU build (the session's shared
server for the HTTP probes, /metrics and the start-up lines; each refused start once, shared with the launcher's
tests of it) into a temporary
directory, and compared with the committed ones, shapes only and with no allowance: any difference is vLLM's
surface moving under the pin, and the fixtures (tests/emulator/fixtures, scripts/record-vllm-conformance) must be
re-recorded and the emulator brought along.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.real_vllm import MAX_MODEL_LEN, SERVED_NAME, RealVllm
from tuner.conformance.compare import compare_http, compare_metrics, compare_startup
from tuner.conformance.fixtures import fixture_dir, read_fixture, write_fixture
from tuner.conformance.record import FAILURES, failure_record, record_server
from tuner.vllm_pin import PINNED_VLLM

pytestmark = pytest.mark.real_vllm

COMMITTED = fixture_dir(Path(__file__).parents[1] / "emulator" / "fixtures")


def test_the_served_surface_has_not_drifted(real_vllm: RealVllm, tmp_path: Path) -> None:
    parts = record_server(real_vllm.base_url, real_vllm.log(), SERVED_NAME, MAX_MODEL_LEN)
    for name, data in parts.items():
        write_fixture(tmp_path, name, PINNED_VLLM, data)
    drift = (
        compare_http(read_fixture(COMMITTED, "http"), read_fixture(tmp_path, "http"))
        + compare_metrics(read_fixture(COMMITTED, "metrics"), read_fixture(tmp_path, "metrics"))
        + compare_startup(
            {"lines": read_fixture(COMMITTED, "startup")["lines"]},
            {"lines": read_fixture(tmp_path, "startup")["lines"]},
        )
    )
    assert not drift, "real vLLM no longer answers as recorded:\n" + "\n".join(drift)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_the_refusals_have_not_drifted(
    name: str, refused_starts: Callable[[str], tuple[str, int | None]], tmp_path: Path
) -> None:
    recorded = failure_record(FAILURES[name], *refused_starts(name))
    write_fixture(tmp_path, "startup", PINNED_VLLM, {"failures": {name: recorded}})
    drift = compare_startup(
        {"failures": {name: read_fixture(COMMITTED, "startup")["failures"][name]}}, read_fixture(tmp_path, "startup")
    )
    assert not drift, "\n".join(drift)
