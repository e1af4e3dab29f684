"""The examples run to completion on the CPU: the script in a subprocess, the notebook in a Jupyter kernel."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def test_inject_and_generate_script(demo_env):
    r = subprocess.run([sys.executable, str(EXAMPLES / "inject_and_generate.py"), "--gpu", "cpu",
                        "--max-new-tokens", "8"], env=demo_env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Qwen3MoeSparseMoeBlock" in r.stdout and "moe" in r.stdout  # the plan was printed
    generated = r.stdout.split("--- reply (up to 8 tokens) ---", 1)[1]
    assert generated.strip(), r.stdout


def _run_notebook(name: str, demo_env, monkeypatch):
    """Execute examples/NAME in a Jupyter kernel (CellExecutionError, naming the cell, if one fails); returns the
    executed notebook."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the test extra: pip install -e .[test]")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra: pip install -e .[test]")
    pytest.importorskip("ipykernel", reason="no Jupyter kernel: ipykernel is in the test extra (.[test])")
    for key, value in demo_env.items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook cleared"
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    return nb


def _text(nb) -> str:
    return "\n".join(out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.outputs)


def test_quickstart_notebook(demo_env, monkeypatch):
    text = _text(_run_notebook("quickstart.ipynb", demo_env, monkeypatch))
    assert "Qwen3MoeSparseMoeBlock" in text  # the plan
    assert text.rstrip().splitlines()[-1].strip()  # the streamed reply


def test_where_experts_go_notebook(demo_env, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra (.[test]) and the plots extra")
    nb = _run_notebook("where_experts_go.ipynb", demo_env, monkeypatch)
    text = _text(nb)
    assert "bytes per device: cpu" in text and "cuda" in text  # the plan, made for a GPU it does not need
    assert "routed (token, slot) pairs over 4 MoE layers x 16 experts" in text  # the calibration
    assert "hot experts (frequency)" in text  # the placement drawn on the heat map
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the bar chart and the heat map
