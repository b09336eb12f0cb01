"""What the sampler tests share: GP's optional packages."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_gp() -> None:
    """GPSampler's torch and scipy, which scripts/test installs (tuner[test]): a skip without them, a failure in CI."""
    missing = [name for name in ("torch", "scipy") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"GPSampler needs {' and '.join(missing)}, not installed (pip install -e '.[test]')"
    if os.environ.get("TUNER_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (TUNER_REQUIRE_SERVICES=1 requires it)", pytrace=False)
    pytest.skip(message)
