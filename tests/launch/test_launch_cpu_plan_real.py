"""The CPU plan on real vLLM (the pinned CPU build): its worker's threads run on the worker's cores, its API server
and engine core on the others, read from /proc as a person would check it. The server is the session's
`launched_vllm`, started on a plan (the shared `real_vllm` is started without one)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.real_vllm import LaunchedVllm
from tuner.launch.affinity import parse_cpu_list
from tuner.launch.pinning import group_members, usable_cpus

pytestmark = pytest.mark.real_vllm

# `(Worker pid=41)`, `(EngineCore_DP0 pid=40)`, `(APIServer pid=39)`: who is who, as vLLM's own log says
WRITER = re.compile(r"\((?P<role>[A-Za-z]+)(?:_\w+)? pid=(?P<pid>\d+)\)")


def cpus_allowed(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of `pid` and its Cpus_allowed_list."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1].strip())
    return out


async def test_the_worker_and_the_other_processes_run_where_the_plan_says(launched_vllm: LaunchedVllm) -> None:
    plan, server = launched_vllm.plan, launched_vllm.server
    if plan is None:
        pytest.skip(f"one usable core ({sorted(usable_cpus())}): nothing to split")
    assert server.failure() is None, "the server died before its placement was read"
    assert server.cpu_plan == plan, server.logs()[-3000:]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        # placed and answering: the API server and engine core serve from their cores (a completion through the
        # worker is what the real study's trials run, placed the same way: test_tune_real.py; here, in CI, the
        # engine core once lost its worker on the first completion, "RuntimeError: cancelled", not understood)
        response = await client.get("/v1/models")
        assert response.status_code == 200, f"{response.text}\n{server.logs()[-4000:]}"
    roles = {m["role"]: int(m["pid"]) for m in WRITER.finditer(server.logs())}
    assert {"Worker", "EngineCore", "APIServer"} <= set(roles), sorted(roles)
    (record,) = launched_vllm.launcher.registry.records()
    members = group_members(record.pgid)
    assert {roles["Worker"], roles["EngineCore"], roles["APIServer"]} <= set(members)
    worker = cpus_allowed(roles["Worker"])
    assert all(cores <= plan.worker for cores in worker.values()), worker
    assert plan.worker in worker.values()  # the OpenMP threads, bound where VLLM_CPU_OMP_THREADS_BIND said
    for pid in members:
        if pid != roles["Worker"]:  # the API server, the engine core, and any helper process of theirs
            assert set(cpus_allowed(pid).values()) == {plan.others}, (pid, cpus_allowed(pid))
