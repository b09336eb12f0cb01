"""How the suite is shared out on workers (tests/xdist_groups.py), on a small suite written here and run by pytest
with two workers: real-vLLM files on one worker, a module whole, an `exclusive` test refused beside others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_groups import REAL_GROUP, group_of, rank

ROOT = Path(__file__).resolve().parents[1]

INI = """[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    exclusive: restarts a shared service
"""

# Each test writes which worker ran it, under its own name.
RECORD = """import os, pathlib


def record(name):
    pathlib.Path(os.environ["WHERE"], name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))
"""


def _module(stem: str, n: int, fixture: str = "") -> str:
    tests = [f"def test_{stem}_{i}({fixture}):\n    record('{stem}_{i}')\n" for i in range(n)]
    return "from record import record\n\n\n" + "\n\n".join(tests)


def _pytest(suite: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), str(suite), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "WHERE": str(suite / "ran")}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):  # where this test itself runs on a worker
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.xdist_groups", "-p", "no:cacheprovider", *args],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _suite(tmp_path: Path, modules: dict[str, str]) -> Path:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "record.py").write_text(RECORD)
    (tmp_path / "ran").mkdir()
    for name, text in modules.items():  # laid out as ours are: under tests/, a package's folder below it
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text(text)
    return tmp_path


def _workers(suite: Path, stem: str) -> set[str]:
    return {p.read_text() for p in (suite / "ran").glob(f"{stem}_*")}


def test_a_test_goes_with_its_module_its_shared_folder_or_the_real_vllm_group() -> None:
    assert group_of("tests/study/test_tune_real.py::test_x", ROOT) == REAL_GROUP
    assert group_of("tests/load/test_load_real.py::TestA::test_b[1]", ROOT) == REAL_GROUP
    assert group_of("tests/store/test_store.py::TestA::test_b[sqlite]", ROOT) == "tests/store/test_store.py"
    assert group_of("tests/store/test_store.py::test_c", ROOT) == "tests/store/test_store.py"
    # tests/ship/conftest.py runs a study for the session: its folder is one group
    assert group_of("tests/ship/test_plan.py::test_x", ROOT) == group_of("tests/ship/test_rules.py::test_y", ROOT)
    assert group_of("tests/ship/test_plan.py::test_x", ROOT) == "tests/ship/"
    # the top conftest's session fixtures are cheap: the top modules stay apart
    assert group_of("tests/test_export.py::test_x", ROOT) == "tests/test_export.py"


def test_groups_go_out_real_vllm_first_then_those_with_slow_tests() -> None:
    assert rank(REAL_GROUP, ROOT) == 0
    assert rank("tests/study/test_study_e2e.py", ROOT) == 1  # pytest.mark.slow
    assert rank("tests/ship/", ROOT) == 1  # a folder group: any of its files
    assert rank("tests/store/test_store.py", ROOT) == rank("tests/test_export.py", ROOT) == 2
    assert rank("tests/no_such_file.py", ROOT) == 2


def test_on_two_workers_the_real_files_share_one_and_each_module_stays_whole(tmp_path: Path) -> None:
    modules = {f"test_{stem}_real.py": _module(stem, 3) for stem in ("start", "load", "refusal")}
    modules |= {f"test_{stem}.py": _module(stem, 4) for stem in ("store", "report", "cli", "twin")}
    shared = 'import pytest\n\n\n@pytest.fixture(scope="session")\ndef study():\n    return 1\n'
    modules |= {"ship/conftest.py": shared} | {f"ship/test_{stem}.py": _module(stem, 2) for stem in ("plan", "rules")}
    suite = _suite(tmp_path, modules)
    run = _pytest(suite, "-n", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "29 passed" in run.stdout
    real = _workers(suite, "start") | _workers(suite, "load") | _workers(suite, "refusal")
    assert len(real) == 1 and real <= {"gw0", "gw1"}, real
    for stem in ("store", "report", "cli", "twin"):
        assert len(_workers(suite, stem)) == 1, stem
    assert len(_workers(suite, "plan") | _workers(suite, "rules")) == 1


def test_an_exclusive_test_fails_beside_other_workers_and_runs_alone(tmp_path: Path) -> None:
    restart = "import pytest\n\npytestmark = pytest.mark.exclusive\n\n" + _module("restart", 1)
    suite = _suite(tmp_path, {"test_restart.py": restart, "test_other.py": _module("other", 2)})
    beside = _pytest(suite, "-n", "2")
    assert beside.returncode == 1, beside.stdout
    assert "1 error" in beside.stdout and "marked exclusive (it stops or restarts a shared service)" in beside.stdout
    assert not _workers(suite, "restart")  # refused before its body ran
    alone = _pytest(suite, "-m", "exclusive")
    assert alone.returncode == 0 and "1 passed, 2 deselected" in alone.stdout, alone.stdout
    assert _workers(suite, "restart") == {"none"}


def test_a_real_vllm_test_outside_a_real_file_stops_the_run_with_its_name(tmp_path: Path) -> None:
    conftest = "import pytest\n\n\n@pytest.fixture\ndef vllm_python():\n    return 'python'\n"
    suite = _suite(tmp_path, {"conftest.py": conftest, "test_stray.py": _module("stray", 1, "vllm_python")})
    run = _pytest(suite)
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "real-vLLM tests must sit in a test_*_real.py file" in run.stderr + run.stdout
    assert "test_stray.py::test_stray_0" in run.stderr + run.stdout
