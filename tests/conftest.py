"""Fixtures shared by the test files that start ktinject in subprocesses (chat, serve, examples, README); torch's
OpenMP wait policy and the number of pytest-xdist workers for the whole suite."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# torch's OpenMP workers (libgomp) spin-wait between parallel regions by default, taking the cores the native
# expert threads and the other torch thread need: on the 2 CI cores that made every CPU decode step several times
# slower (the suite ~2x). PASSIVE makes them sleep instead; it changes no result. Set before torch is imported
# (libgomp reads it once), so for this process and, through os.environ, every subprocess the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_xdist_auto_num_workers(config):
    """Workers for pyproject.toml's `-n auto`: one per CPU this process may use (up to 8), on a machine without CUDA;
    none (the tests run in this process, as without pytest-xdist) where CUDA is, since the GPU tests share the one
    device and measure its memory and speed, or where there is one CPU. An explicit -n N still wins."""
    import torch

    cpus = min(len(os.sched_getaffinity(0)), 8)
    return 0 if cpus < 2 or torch.cuda.is_available() else cpus


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
