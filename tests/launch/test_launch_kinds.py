"""Each launcher kind the job's schema registers is built here, and what its `options:` may pass is what its
launcher takes: the schema sits below the launchers and cannot read their signatures itself."""

from __future__ import annotations

import inspect

import pytest

from tuner.config import LAUNCHER_KINDS, parse_job
from tuner.errors import ConfigError
from tuner.launch.factory import LAUNCHERS


@pytest.mark.parametrize("name", list(LAUNCHER_KINDS))
def test_a_kinds_options_are_the_keywords_its_launcher_takes_beside_the_jobs_own(name: str) -> None:
    kind, options = LAUNCHERS[name], LAUNCHER_KINDS[name]
    params = inspect.signature(kind.launcher.__init__).parameters
    takes = {n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
    if "options" not in options.model_fields:
        assert options.keywords == ()  # nothing to pass: the job's own fields are the whole of it
        return
    assert not set(options.keywords) & kind.set_by_job
    assert set(options.keywords) | kind.set_by_job == takes, "a keyword the launcher takes is neither set nor allowed"


@pytest.mark.parametrize("name", [n for n, o in LAUNCHER_KINDS.items() if o.keywords])
def test_an_option_the_launcher_does_not_take_is_named_with_those_it_does(name: str) -> None:
    data = {
        "study": {"name": "s"},
        "target": {"launcher": name, "model": "llama-3.1-8b", "gpu": "l4", name: {"options": {"stop_grace": 5}}},
        "space": {"max_num_seqs": {"low": 8, "high": 16}},
        "arrival": {"concurrency": 1, "requests": 2},
    }
    with pytest.raises(ConfigError) as e:
        parse_job(data)
    allowed = ", ".join(sorted(LAUNCHER_KINDS[name].keywords))
    assert str(e.value) == (
        f"job: target.{name}.options.stop_grace: not an option of the {name} launcher; allowed: {allowed}; "
        "did you mean stop_grace_s?"
    )


def test_an_unknown_kind_is_refused_naming_the_registered_ones() -> None:
    data = {"study": {"name": "s"}, "target": {"launcher": "k8s", "model": "m"}, "space": {}, "arrival": {}}
    with pytest.raises(ConfigError) as e:
        parse_job(data)
    assert "job: target.launcher: Input should be 'emulator', 'process' or 'docker'" in str(e.value).splitlines()
