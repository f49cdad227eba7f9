"""Fixtures shared across test modules."""
from __future__ import annotations

import pytest

from tests.distributed import REPO_ROOT


@pytest.fixture(scope="session")
def demo_model():
    """The demo's SFT'd tiny Llama in .cache/models/demo-arith, built once (~1 min) and reused, as `make demo` does."""
    from launch.prepare_demo_model import prepare_demo_model

    return prepare_demo_model(REPO_ROOT / ".cache" / "models" / "demo-arith")
