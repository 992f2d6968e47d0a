"""Fixtures shared by the vLLM end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """A tiny Llama built locally (no model hub here), cached between runs."""
    from .tiny_model import build

    cache = Path(os.environ.get("KVSTREAM_E2E_CACHE", Path.home() / ".cache" / "kvstream-e2e"))
    return build(cache / "tinyllama-v1")
