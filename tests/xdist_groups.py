"""How the suite shares out its tests on several workers (pytest-xdist, `scripts/pytest-suite`): which tests must
run on one worker, and which must not run beside any other test. A plugin of the whole suite (tests/conftest.py).

- The real-vLLM tests (`tests/<package>/test_*_real.py`) share session-scoped started servers and refused starts
  (tests/real_vllm.py): on two workers each would start its own, two more vLLM starts on a 2-core machine. They are
  one group, on one worker, sent out first: they are the longest group by far.
- A folder whose conftest.py holds session- or package-scoped fixtures (tests/ship/: a study run by `tuner tune`)
  is one group: on two workers each would run it. The top conftest's (tests/conftest.py) take a second or two.
- Every other test goes with its module: a module-scoped fixture (a study run once, a recorded emulator) is built
  once, not once a worker.
- A test that stops or restarts a shared service (the PostgreSQL cluster every `postgres` test uses) is marked
  `exclusive`: no scheduler can keep it apart, since the controller sees test ids and not markers, so the suite
  runs those before the parallel run, alone (`-m exclusive`, no workers), and one reaching a worker beside others
  fails with that reason rather than pull the database from under them.

Groups are told from the test id alone because that is all the controller has: pytest 9.2 builds a node's id from
its parts, so xdist's own `loadgroup` (which appends `@group` to the id on the worker) groups nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

REAL_GROUP = "real vLLM"
# Every fixture of the real tier rests on these two: a test asking for one must be in a `_real.py` file to be grouped.
REAL_FIXTURES = frozenset({"vllm_python", "tiny_model"})


def group_of(nodeid: str, root: Path) -> str:
    """The work unit a test goes in (its id relative to `root`, the rootdir): the real-vLLM group, its folder, or its
    module."""
    path = nodeid.split("::", 1)[0]
    if path.endswith("_real.py"):
        return REAL_GROUP
    folder = PurePosixPath(path).parent
    if len(folder.parts) > 1 and _shares_fixtures(root / folder / "conftest.py"):
        return f"{folder}/"
    return path


def rank(group: str, root: Path) -> int:
    """The order groups are sent out in: the real-vLLM group (minutes of starts), then groups with a test marked
    `slow` (seconds each), then the rest. Read from the files: the controller has no markers."""
    if group == REAL_GROUP:
        return 0
    files = sorted((root / group).glob("test_*.py")) if group.endswith("/") else [root / group]
    return 1 if any(_marks_slow(f) for f in files) else 2


@functools.cache
def _marks_slow(path: Path) -> bool:
    try:
        return "mark.slow" in path.read_text(encoding="utf-8")
    except OSError:
        return False


@functools.cache
def _shares_fixtures(conftest: Path) -> bool:
    """The conftest declares a fixture every test of its folder may share across modules. Read as text: the
    controller has test ids, not fixtures."""
    try:
        text = conftest.read_text(encoding="utf-8")
    except OSError:
        return False
    return 'scope="session"' in text or 'scope="package"' in text


def in_parallel() -> bool:
    """This process is one of several xdist workers (xdist sets the count in each worker's environment)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":
        return None  # a distribution mode asked for by name is xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid, config.rootpath)

        def _assign_work_unit(self, node: WorkerController) -> None:
            # Long groups first: one started last is the tail of the run, the other worker idle beside it. The
            # queue comes ordered by test count; a stable sort keeps that order within each rank.
            for group in sorted(self.workqueue, key=lambda g: rank(g, config.rootpath)):
                self.workqueue.move_to_end(group)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A real-vLLM test outside a `_real.py` file would start its own servers on another worker: refuse it here,
    in every run, so that the serial run a contributor makes finds it too."""
    real = [i.nodeid for i in items if REAL_FIXTURES & set(getattr(i, "fixturenames", ()))]
    strays = [nodeid for nodeid in real if group_of(nodeid, config.rootpath) != REAL_GROUP]
    if strays:
        raise pytest.UsageError(f"real-vLLM tests must sit in a test_*_real.py file (tests/xdist_groups.py): {strays}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if in_parallel() and item.get_closest_marker("exclusive") is not None:
        pytest.fail(
            "marked exclusive (it stops or restarts a shared service): run it alone, `-m exclusive` without -n",
            pytrace=False,
        )
