"""Fixtures shared by the test files that start ktinject in subprocesses (chat, serve, examples, README)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _default_int4_group():
    """Tests see the default int4 group rule, module-scoped models too (an A/B script's KTINJECT_INT4_GROUP in the
    shell does not leak in); a test that wants it sets it itself (monkeypatch)."""
    saved = os.environ.pop("KTINJECT_INT4_GROUP", None)
    yield
    if saved is not None:
        os.environ["KTINJECT_INT4_GROUP"] = saved


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


@pytest.fixture(scope="module")
def demo_engine_model(tmp_path_factory):
    """(model, tokenizer) of the demo model on the CPU for a serve engine, with one torch thread while the module
    runs: the engine shares the 2 CI cores with the client threads, and torch's OpenMP workers spin-wait for each
    other (10-50x slower steps whenever another thread takes a core)."""
    import torch

    from ktinject.cli.chat import load_model
    from ktinject.demo import demo_model_dir

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.getbasetemp() / "ktinject-cache"  # shared with demo_env
    model, tokenizer, _ = load_model(demo_model_dir(cache), progress=False, gpu="cpu")
    yield model, tokenizer
    torch.set_num_threads(threads)
