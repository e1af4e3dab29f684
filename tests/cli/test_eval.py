"""python -m ktinject.eval against a hand computation, and the trained demo model's held-out perplexity."""
from __future__ import annotations

import math

import pytest
import torch

from ktinject import demo
from ktinject.cli import eval as kt_eval
from ktinject.tiny_models import build_tiny_model, tiny_prompts

# the demo model at training time: held-out perplexity 52.5 (bf16 autocast, 256-token windows); a broken checkpoint,
# tokenizer or loader lands near the uniform 2048 or the unigram ~400
DEMO_PPL_BOUND = 80.0


def test_scores_equal_a_hand_computation():
    model = build_tiny_model("qwen3_moe", dtype=torch.float32).eval()
    ids = tiny_prompts(1, 23, seed=4)[0]
    chunks = kt_eval.windows(ids, 10)
    assert [len(c) for c in chunks] == [10, 10, 3]
    s, tops = kt_eval.score(model, chunks)
    nll, n = 0.0, 0
    for c in chunks:
        with torch.no_grad():
            logp = torch.log_softmax(model(c[None]).logits[0].double(), -1)
        for t in range(len(c) - 1):
            nll -= float(logp[t, c[t + 1]])
            n += 1
    assert s.n == n == 9 + 9 + 2 and s.agree == n
    assert s.perplexity == pytest.approx(math.exp(nll / n), rel=1e-5)
    other, _ = kt_eval.score(model, chunks, [torch.full_like(t, -1) for t in tops])
    assert other.agree == 0 and other.agreement == 0.0


def test_unigram_is_the_in_sample_maximum_likelihood():
    chunks = [torch.tensor([9, 1, 1, 2]), torch.tensor([9, 1])]  # predicted: 1, 1, 2, 1
    p1, p2 = 3 / 4, 1 / 4
    assert kt_eval.unigram_perplexity(chunks) == pytest.approx(math.exp(-(3 * math.log(p1) + math.log(p2)) / 4))
    with pytest.raises(ValueError, match="window"):
        kt_eval.windows(torch.arange(5), 1)


def test_demo_model_ships_trained_and_checked():
    path = demo.demo_model_dir()
    assert (path / "model.safetensors").stat().st_size > 1_000_000 and demo.heldout_text().count("\n%\n") > 100
    rows = kt_eval.run(path, demo.heldout_text(), ["int8"], gpu="cpu", window=128, max_tokens=1536)
    (_, ref), (_, int8), (_, unigram) = rows
    assert ref.perplexity < DEMO_PPL_BOUND, ref.perplexity
    assert ref.perplexity < unigram.perplexity / 3  # learned far more than token frequencies
    assert int8.perplexity < ref.perplexity * 1.05 and int8.agreement > 0.9
    assert "unigram" in kt_eval.table(rows)


def test_a_tampered_demo_file_is_refused(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "demo_model"
    shutil.copytree(demo.TRAINED, copy)
    (copy / "heldout.txt").write_text("changed")
    monkeypatch.setattr(demo, "TRAINED", copy)
    with pytest.raises(demo.DemoModelError, match="checksum"):
        demo.demo_model_dir()
