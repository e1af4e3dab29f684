"""The streaming loader (``ktinject.from_pretrained``) on the families added after the first eight (``MORE_FAMILIES``:
Qwen3.5-MoE, Qwen3-Next, MiniMax-M2, DeepSeek-V3.2, GLM-5, Kimi-K2.5, Llama 4, ...): a tiny random bf16 checkpoint
in several shards loads to the same state and the same logits, bit for bit, as transformers' ``from_pretrained``
followed by ``ktinject.inject`` (Llama 4's transposed experts included, and Kimi-K2.5's vision tower, whose fused
``wqkv`` transformers chunks into q / k / v and permutes for rope: the loader runs transformers' own conversion)."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.tiny_models import MIN_TRANSFORMERS, MORE_FAMILIES, build_tiny_model, tiny_prompts


def _skip_if_too_old(family: str) -> None:
    import transformers
    from packaging.version import Version

    need = MIN_TRANSFORMERS.get(family)
    if need and Version(transformers.__version__) < Version(need):
        pytest.skip(f"{family} needs transformers >= {need}")


#: families whose checkpoints the streaming loader refuses with a clear error (the last test), none today
NOT_STREAMED: tuple[str, ...] = ()


@pytest.mark.parametrize("family", [f for f in MORE_FAMILIES if f not in NOT_STREAMED])
def test_streamed_load_equals_transformers_plus_inject(tmp_path, family):
    _skip_if_too_old(family)
    built = build_tiny_model(family, seed=1, dtype=torch.bfloat16)
    built.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ref = type(built).from_pretrained(tmp_path)  # the family's own class (Kimi-K2.5 is image-text)
    ktinject.inject(ref, gpu="cpu")
    model = ktinject.from_pretrained(tmp_path, gpu="cpu", cache_dir=False, progress=False)
    ref_sd, sd = ref.state_dict(), model.state_dict()
    assert ref_sd.keys() == sd.keys()
    for k in ref_sd:
        assert ref_sd[k].dtype == sd[k].dtype and torch.equal(ref_sd[k], sd[k]), k
    ids = tiny_prompts(2, 7, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

