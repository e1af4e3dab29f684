"""Fixtures shared by the test files that start ktinject in subprocesses (chat, serve, examples, README)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_env(tmp_path_factory):
    """Environment for subprocesses: this process's, offline, this checkout importable, unbuffered output, and the
    demo model's packed cache in one directory per session (built once, shared by every test file that uses it)."""
    from ktinject.demo import demo_model_dir

    cache = tmp_path_factory.getbasetemp() / "ktinject-cache"
    demo_model_dir(cache)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, KTINJECT_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
