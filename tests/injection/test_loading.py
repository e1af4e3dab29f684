"""Streaming checkpoint loading (ktinject.injection.loading) against transformers' from_pretrained + inject.

Every family: a tiny random bf16 model saved in several small shards loads to the same logits, bit for bit, as
``AutoModelForCausalLM.from_pretrained`` followed by ``ktinject.inject`` (same packed weights). Then: the
packed-experts cache (used, bit-identical, invalidated), the meta-model paths, errors naming tensor and file, and
peak host memory while loading.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ktinject
from ktinject import native
from ktinject.injection.loading import LoadError, load_into
from ktinject.operators import register
from ktinject.operators.moe import MoEOperator
from ktinject.injection.plan import plan
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_env_cache(monkeypatch):
    monkeypatch.delenv("KTINJECT_CACHE", raising=False)


_SAVED: dict[tuple, Path] = {}


def saved(tmp_path_factory, family: str, **overrides) -> Path:
    """A tiny bf16 checkpoint of ``family`` in several shards (built once per session)."""
    key = (family, tuple(sorted(overrides.items())))
    if key not in _SAVED:
        d = tmp_path_factory.mktemp(f"ckpt-{family}")
        model = build_tiny_model(family, seed=1, dtype=torch.bfloat16, **overrides)
        model.save_pretrained(d, max_shard_size="50KB")
        assert len(list(d.glob("*.safetensors"))) > 2, "the test needs a checkpoint in several shards"
        _SAVED[key] = d
    return _SAVED[key]


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@torch.no_grad()
def logits(model) -> torch.Tensor:
    ids = tiny_prompts(2, 7, seed=3).to(model.get_input_embeddings().weight.device)
    return model(ids).logits.cpu()


def hf_injected(d: Path, gpu="cpu", **kw):
    from transformers import AutoModelForCausalLM

    from ktinject.injection.inject import inject

    model = AutoModelForCausalLM.from_pretrained(d)
    inject(model, gpu=gpu, **kw)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_same_logits_as_transformers_plus_inject(tmp_path_factory, family):
    d = saved(tmp_path_factory, family)
    ref = hf_injected(d)
    model = ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False)
    assert model._ktinject_load_stats["cache"] == "off"
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    ref_sd, sd = ref.state_dict(), model.state_dict()
    assert ref_sd.keys() == sd.keys()
    for k in ref_sd:
        assert ref_sd[k].dtype == sd[k].dtype and torch.equal(ref_sd[k], sd[k]), k
    assert torch.equal(logits(model), logits(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_cuda_same_logits_as_transformers_plus_inject(tmp_path_factory, family):
    d = saved(tmp_path_factory, family)
    ref = hf_injected(d, gpu="cuda")
    model = ktinject.from_pretrained(d, gpu="cuda", cache_dir=False, progress=False)
    assert model.get_input_embeddings().weight.device.type == "cuda"
    assert {d.split(":")[0] for d in model._ktinject_load_stats["resident"]} == {"cpu", "cuda"}
    assert torch.equal(logits(model), logits(ref))


def test_int8_and_tied_embeddings(tmp_path_factory):
    d = saved(tmp_path_factory, "qwen3_moe", tie_word_embeddings=True)
    ref = hf_injected(d, quant="int8")
    model = ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=False, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(ref))


def test_cache_is_used_bit_identical_and_invalidated(tmp_path_factory, tmp_path, monkeypatch, caplog):
    from ktinject import native

    d = copy_ckpt(saved(tmp_path_factory, "deepseek_v3"), tmp_path / "ckpt")
    cache = tmp_path / "cache"
    first = ktinject.from_pretrained(d, gpu="cpu", cache_dir=cache, progress=False)
    assert first._ktinject_load_stats["cache"] == "written"
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file()
    expected = logits(first)

    def no_packing(*a, **k):
        raise AssertionError("Experts.set called although the cache holds the packed experts")

    with monkeypatch.context() as m:
        m.setattr(native.Experts, "set", no_packing)
        second = ktinject.from_pretrained(d, gpu="cpu", cache_dir=cache, progress=False)
    assert second._ktinject_load_stats["cache"] == "hit"
    assert torch.equal(logits(second), expected)
    # a truncated cache file is not trusted: repacked (and rewritten)
    block = sorted(entries[0].glob("*.safetensors"))[0]
    block.write_bytes(block.read_bytes()[:1000])
    again = ktinject.from_pretrained(d, gpu="cpu", cache_dir=cache, progress=False)
    assert again._ktinject_load_stats["cache"] == "written"
    assert torch.equal(logits(again), expected)

    # quant changes -> miss; the other packing of the same files stays (int4 and int8 starts take turns)
    third = ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=cache, progress=False)
    assert third._ktinject_load_stats["cache"] == "written"
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2
    assert ktinject.from_pretrained(d, gpu="cpu", cache_dir=cache, progress=False)._ktinject_load_stats["cache"] \
        == "hit"
    # rules change -> miss
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {class: DeepseekV3MoE}\n  replace: moe\n  kwargs: {quant: int8}\n"
                     "- match: {name: lm_head}\n  device: cpu\n- include: common.yaml\n")
    # rules that change where things go but not the packing (int8 again, lm_head on the CPU) -> the same entry
    fourth = ktinject.from_pretrained(d, rules, gpu="cpu", cache_dir=cache, progress=False)
    assert fourth._ktinject_load_stats["cache"] == "hit"
    assert torch.equal(logits(fourth), logits(third))
    # checkpoint changes (a shard rewritten) -> miss
    shard = sorted(d.glob("*.safetensors"))[-1]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    fifth = ktinject.from_pretrained(d, rules, gpu="cpu", cache_dir=cache, progress=False)
    assert fifth._ktinject_load_stats["cache"] == "written"
    # ... and the entries made from the old files are removed
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [Path(fifth._ktinject_load_stats[
        "cache_dir"]).name]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # gpt-oss: expert biases read again as well
def test_corrupted_cache_block_is_repacked_not_used(tmp_path_factory, tmp_path, caplog, family):
    """A cache block whose bytes changed but whose size did not (bit rot, a partial overwrite) fails its digest:
    that block is packed from the checkpoint, the logits are the cold load's, and the entry is written anew."""
    d = copy_ckpt(saved(tmp_path_factory, family), tmp_path / "ckpt")
    cache = tmp_path / "cache"
    cold = ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=cache, progress=False)
    expected = logits(cold)
    entry, = [p for p in cache.iterdir() if not p.name.startswith(".")]
    block = sorted(entry.glob("*.safetensors"))[1]
    raw = bytearray(block.read_bytes())
    raw[-200:-100] = bytes(100)  # inside the packed bytes, size unchanged
    block.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="ktinject.injection.loading"):
        warm = ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=cache, progress=False)
    assert warm._ktinject_load_stats["cache"] == "corrupted: 1 blocks repacked"
    assert f"{block} is corrupted" in caplog.text and "packing block" in caplog.text
    assert torch.equal(logits(warm), expected)
    assert not entry.exists()  # removed after the load ...
    again = [ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=cache, progress=False)
             for _ in range(2)]  # ... and written anew
    assert [m._ktinject_load_stats["cache"] for m in again] == ["written", "hit"]
    assert torch.equal(logits(again[1]), expected)


def test_cache_key_holds_the_int4_group(tmp_path_factory, tmp_path, monkeypatch):
    """An int4 entry packed in one group size is never read back as another (KTINJECT_INT4_GROUP changes the key)."""
    d = copy_ckpt(saved(tmp_path_factory, "deepseek_v3"), tmp_path / "ckpt")
    cache = tmp_path / "cache"

    def load(group: str):
        monkeypatch.setenv("KTINJECT_INT4_GROUP", group)
        model = ktinject.from_pretrained(d, quant="int4", gpu="cpu", cache_dir=cache, progress=False)
        groups = {b.native_experts.group_size for b in _hybrids(model)}
        return model._ktinject_load_stats["cache"], groups

    assert load("32") == ("written", {32})
    assert load("64") == ("written", {64})
    assert load("64") == ("hit", {64})
    # (both entries stay: other packings of the same files are not stale)
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 2
    # a manifest whose block layout is not the experts' (same bytes can be another layout) is never read: those
    # blocks are packed from the checkpoint, and the entry is written anew at the next start
    entry, = [p for p in entries if "group 64" in (p / "manifest.json").read_text()]
    manifest = json.loads((entry / "manifest.json").read_text())
    for block in manifest["blocks"].values():
        block[2] = block[2].replace("group 64", "group 128")
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert load("64") == (f"corrupted: {len(manifest['blocks'])} blocks repacked", {64})
    assert load("64") == ("written", {64})
    # the rules' group_size streams in that group too, and reads the entry of that packing (written by group 32
    # from the environment above: the rest of the rules is not in the key)
    monkeypatch.delenv("KTINJECT_INT4_GROUP")
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {class: DeepseekV3MoE}\n  replace: moe\n  kwargs: {quant: int4, group_size: 32}\n"
                     "- include: common.yaml\n")
    model = ktinject.from_pretrained(d, rules, gpu="cpu", cache_dir=cache, progress=False)
    assert model._ktinject_load_stats["cache"] == "hit"
    assert {b.native_experts.group_size for b in _hybrids(model)} == {32}
    # KEEP = 3 packings per checkpoint: a fourth drops the least recently used (group 64, read longest ago)
    from ktinject.injection import pack_cache as packcache

    assert packcache.KEEP == 3
    assert load("128")[0] == "written" and load("32")[0] == "hit"  # three packings: 64, 128, 32 (newest use)
    int8 = ktinject.from_pretrained(d, quant="int8", gpu="cpu", cache_dir=cache, progress=False)
    assert int8._ktinject_load_stats["cache"] == "written"
    kept = [(p / "manifest.json").read_text() for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(kept) == 3 and not any("group 64" in m for m in kept)
    assert sum("group 32" in m for m in kept) == sum("group 128" in m for m in kept) == 1


def test_cache_default_place_and_policy(tmp_path_factory, tmp_path, monkeypatch):
    d = copy_ckpt(saved(tmp_path_factory, "gpt_oss"), tmp_path / "ckpt")
    # default: no cache for bf16 experts (as many bytes as the checkpoint's: no faster to read back)
    assert ktinject.from_pretrained(d, gpu="cpu", progress=False)._ktinject_load_stats["cache"] == "off"
    # int8: next to the checkpoint
    a = ktinject.from_pretrained(d, quant="int8", gpu="cpu", progress=False)
    assert (d / ".ktinject-cache").is_dir() and a._ktinject_load_stats["cache"] == "written"
    b = ktinject.from_pretrained(d, quant="int8", gpu="cpu", progress=False)
    assert b._ktinject_load_stats["cache"] == "hit"
    assert torch.equal(logits(a), logits(b))
    # cache_dir=True or $KTINJECT_CACHE: also for bf16
    assert ktinject.from_pretrained(d, gpu="cpu", cache_dir=True, progress=False)._ktinject_load_stats["cache"] \
        == "written"
    monkeypatch.setenv("KTINJECT_CACHE", str(tmp_path / "env-cache"))
    assert ktinject.from_pretrained(d, gpu="cpu", progress=False)._ktinject_load_stats["cache"] == "written"
    assert (tmp_path / "env-cache").is_dir()
    monkeypatch.setenv("KTINJECT_CACHE", "off")
    assert ktinject.from_pretrained(d, quant="int8", gpu="cpu", progress=False)._ktinject_load_stats["cache"] \
        == "off"


def test_meta_model_load_into_and_inject_checkpoint(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ktinject.injection.inject import inject

    d = saved(tmp_path_factory, "mixtral")
    ref = logits(hf_injected(d))
    config = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    p = plan(model, gpu="cpu")
    assert load_into(model, p, d, cache_dir=False, progress=False) is p
    assert model._ktinject_plan is p
    assert torch.equal(logits(model.eval()), ref)
    # transformers' own meta model (device_map="meta"): its rotary buffers are meta too
    meta = AutoModelForCausalLM.from_pretrained(d, device_map="meta")
    load_into(meta, plan(meta, gpu="cpu"), d, cache_dir=False, progress=False)
    assert not hasattr(meta, "hf_device_map") and not meta.training
    assert torch.equal(logits(meta), ref)

    # the user-facing form of the same: inject(meta_model, checkpoint=dir)
    meta = AutoModelForCausalLM.from_pretrained(d, device_map="meta")
    inject(meta, gpu="cpu", checkpoint=d)
    assert torch.equal(logits(meta.eval()), ref)


# ---------------------------------------------------------------------------------------------- one apply path


def _hybrids(model):
    from ktinject.gpu_experts.hot.stats import hybrid_blocks

    return [b for _, b in hybrid_blocks(model)]


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_gpt_oss_from_checkpoint_keeps_biases_and_gets_hot_experts(tmp_path_factory, tmp_path, quant):
    """Issue 22: a streamed gpt-oss model never set expert_biases, so no expert could go to the GPU. Streamed
    (and from the packed cache) it now holds the biases inject keeps, and places hot experts as inject does."""
    d = copy_ckpt(saved(tmp_path_factory, "gpt_oss"), tmp_path / "ckpt")
    hot = dict(gpu_experts_budget="1GiB", placement="uniform")
    ref = hf_injected(d, quant=quant, **hot)
    want = [b.expert_biases for b in _hybrids(ref)]
    assert all(b.hot is not None and b.hot.residents() == list(range(b.num_experts)) for b in _hybrids(ref))
    for expect in ("written", "hit"):  # the second load reads the packed cache, not the expert weights
        model = ktinject.from_pretrained(d, quant=quant, gpu="cpu", cache_dir=tmp_path / "cache", progress=False,
                                         **hot)
        assert model._ktinject_load_stats["cache"] == expect
        blocks = _hybrids(model)
        for b, (gate_up, down) in zip(blocks, want):
            assert torch.equal(b.expert_biases[0], gate_up) and torch.equal(b.expert_biases[1], down)
            assert b.hot is not None and b.hot.residents() == list(range(b.num_experts))
        assert model._ktinject_placement.strategy == "uniform" and model._ktinject_placement.resident > 0
        assert torch.equal(logits(model), logits(ref))


def test_from_pretrained_takes_the_hot_expert_options(tmp_path_factory):
    """Issue 22: from_pretrained(dir, gpu_experts_budget=...) failed with 'not a torch device'. It takes inject's
    options with inject's defaults (dynamic without statistics, frequency with them)."""
    from ktinject.gpu_experts.hot import placement
    from ktinject.gpu_experts.hot.stats import read_stats, save_stats

    d = saved(tmp_path_factory, "qwen3_moe")
    model = ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False, gpu_experts_budget="64KiB")
    p = model._ktinject_placement
    assert p.strategy == "dynamic" and 0 < p.nbytes <= 64 * 1024
    assert placement.rebalancer(model) is not None and placement.rebalancer(model).every == 64
    ref = hf_injected(d, gpu_experts_budget="64KiB")
    assert ref._ktinject_placement.strategy == "dynamic" and ref._ktinject_placement.experts == p.experts

    logits(model)  # some routing counts, saved as statistics
    stats = save_stats(read_stats(model), Path(d).parent / "stats.json")
    model = ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False, gpu_experts_budget="64KiB",
                                     stats=str(stats), rebalance_every=8)
    assert model._ktinject_placement.strategy == "frequency" and placement.rebalancer(model) is None
    with pytest.raises(ValueError, match=r"gpu_experts_budget: expected 'auto', bytes or a size like '12GiB', or a "
                                         r"share like 0.5, got 'lots'"):
        ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False, gpu_experts_budget="lots")
    with pytest.raises(ValueError, match=r"rebalance_every: expected a positive number of tokens, got 0"):
        ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False, placement="dynamic",
                                 rebalance_every=0)


class _OtherMoE(MoEOperator):
    """The moe operator under another id: the loader must ask the operator, not test for the string "moe"."""


register("moe_under_another_id")(_OtherMoE)


def test_loader_asks_the_operator_for_streamed_experts(tmp_path_factory, tmp_path):
    d = saved(tmp_path_factory, "qwen2_moe")
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {class: Qwen2MoeSparseMoeBlock}\n  replace: moe_under_another_id\n"
                     "- include: common.yaml\n")

    def no_from_hf(*a, **k):
        raise AssertionError("the block was materialized and packed whole instead of streamed")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(native.Experts, "from_hf", no_from_hf)
        model = ktinject.from_pretrained(d, str(rules), gpu="cpu", cache_dir=False, progress=False)
    assert len(_hybrids(model)) > 0
    assert torch.equal(logits(model), logits(hf_injected(d)))


# ---------------------------------------------------------------------------------------------- errors


def _single_file(tmp_path: Path, src: Path, edit) -> Path:
    """A one-file checkpoint with src's config and its tensors after ``edit(dict)``."""
    out = tmp_path / "edited"
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _load(d):
    return ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False)


def test_missing_and_corrupted_shards(tmp_path_factory, tmp_path):
    d = copy_ckpt(saved(tmp_path_factory, "olmoe"), tmp_path / "ckpt")
    shard = sorted(d.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # truncated
    with pytest.raises(LoadError, match=rf"{shard.name}.*(truncated|holds only)"):
        _load(d)
    shard.write_bytes(b"\xff" * 64)  # garbage header
    with pytest.raises(LoadError, match=rf"shard .*{shard.name} is not a readable safetensors"):
        _load(d)
    shard.unlink()
    with pytest.raises(LoadError, match=rf"shard .*{shard.name} is missing.*e\.g\. model\."):
        _load(d)


def test_overlapping_offsets_and_bad_index_entries(tmp_path_factory, tmp_path):
    """Header offsets that overlap (two tensors reading the same bytes) are refused as the safetensors library
    refuses them; an index whose weight_map is not an object, or names a file outside the checkpoint, is named."""
    d = copy_ckpt(saved(tmp_path_factory, "olmoe"), tmp_path / "ckpt")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a, b = names[0], names[1]
    if header[a]["data_offsets"][1] - header[a]["data_offsets"][0] == \
            header[b]["data_offsets"][1] - header[b]["data_offsets"][0]:
        header[b]["data_offsets"] = header[a]["data_offsets"]  # b reads a's bytes
    else:
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + header[b][
            "data_offsets"][1] - header[b]["data_offsets"][0]]
    body = json.dumps(header).encode()  # (offsets count from the data's start: the header may change length)
    shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    with pytest.raises(LoadError, match=rf"{shard.name}.*overlaps tensor"):
        _load(d)
    shard.write_bytes(raw)
    index = d / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    bad = dict(good, weight_map=list(good["weight_map"]))
    index.write_text(json.dumps(bad))
    with pytest.raises(LoadError, match=r"\"weight_map\" is a list, expected an object"):
        _load(d)
    # shards in a subdirectory of the checkpoint (transformers joins the names to the directory too): loaded
    (d / "shards").mkdir()
    for f in sorted(d.glob("model-*.safetensors")):
        f.rename(d / "shards" / f.name)
    index.write_text(json.dumps(dict(good, weight_map={k: f"shards/{v}" for k, v in good["weight_map"].items()})))
    assert torch.equal(logits(_load(d)), logits(_load(saved(tmp_path_factory, "olmoe"))))
    key = next(iter(good["weight_map"]))
    index.write_text(json.dumps(dict(good, weight_map={**good["weight_map"], key: "../../etc/passwd"})))
    with pytest.raises(LoadError, match=rf"tensor '{re.escape(key)}' is mapped to '../../etc/passwd'.*inside the "
                                        r"checkpoint directory \(relative, no '\.\.'\)"):
        _load(d)


def test_bad_environment_numbers_are_named(tmp_path_factory, monkeypatch):
    d = saved(tmp_path_factory, "olmoe")
    monkeypatch.setenv("KTINJECT_READAHEAD_MB", "abc")
    with pytest.raises(ValueError, match=r"KTINJECT_READAHEAD_MB='abc' is not an integer"):
        _load(d)
    monkeypatch.setenv("KTINJECT_READAHEAD_MB", "0")
    with pytest.raises(ValueError, match=r"KTINJECT_READAHEAD_MB=0 is below 1"):
        _load(d)
    monkeypatch.delenv("KTINJECT_READAHEAD_MB")
    monkeypatch.setenv("KTINJECT_PACK_THREADS", "x")
    with pytest.raises(ValueError, match=r"KTINJECT_PACK_THREADS='x'"):
        _load(d)


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "fp8"])
def test_bad_tensors_are_named(tmp_path_factory, tmp_path, case):
    src = saved(tmp_path_factory, "qwen2_moe")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"

    def edit(t):
        if case == "missing":
            del t[key]
        elif case == "unexpected":
            t["model.layers.1.mlp.surprise.weight"] = torch.zeros(2, 2)
        elif case == "shape":
            t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1], dtype=t[key].dtype)
        else:
            t[key] = t[key].float().to(torch.float8_e4m3fn)

    d = _single_file(tmp_path, src, edit)
    match = {
        "missing": r"lacks 1 tensors.*model\.layers\.1\.mlp\.experts\.gate_up_proj",
        "unexpected": r"unexpected tensor 'model\.layers\.1\.mlp\.surprise\.weight' in .*model\.safetensors",
        "shape": rf"'{key}' in .*model\.safetensors has shape \[33, 64\]",
        "fp8": rf"'{key}' in .*model\.safetensors has dtype F8_E4M3",
    }[case]
    with pytest.raises(LoadError, match=match):
        _load(d)


def test_quantized_config_is_refused(tmp_path_factory, tmp_path):
    d = copy_ckpt(saved(tmp_path_factory, "mixtral"), tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"says 'fp8' but the tensors hold no quantized tensor"):
        _load(d)


# ---------------------------------------------------------------------------------------------- memory


_RSS_CHILD = textwrap.dedent("""
    import json, sys
    import ktinject
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    warmup, d = sys.argv[1:]
    ktinject.from_pretrained(warmup, gpu="cpu", cache_dir=False, progress=False)  # imports, native library, pool
    base = hwm()
    model = ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False)
    print(json.dumps({"base": base, "peak": hwm(), "resident": sum(model._ktinject_load_stats["resident"].values())}))
""")


def test_peak_rss_is_resident_plus_one_layer(tmp_path_factory, tmp_path):
    # 4 layers of 64 experts 256 x 512: ~50 MB per layer (bf16), ~200 MB in all, 20 MB shards
    d = tmp_path / "ckpt"
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, hidden_size=512, moe_intermediate_size=256,
                             num_experts=64, num_hidden_layers=4, mlp_only_layers=[], vocab_size=1024)
    model.save_pretrained(d, max_shard_size="20MB")
    layer = sum(t.numel() * t.element_size() for t in model.model.layers[0].parameters())
    del model
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, KTINJECT_READAHEAD_MB="8", PYTHONPATH=path)
    warmup = saved(tmp_path_factory, "qwen3_moe")
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(warmup), str(d)], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    assert grown <= r["resident"] + layer + (24 << 20), (grown, r, layer)


def test_cache_root_never_inside_the_package(tmp_path, monkeypatch):
    """The built-in demo model lies inside the installed package: its packed cache goes to the user's cache
    directory, not next to it (site-packages may be read-only; a checkout would grow untracked files)."""
    from ktinject import demo
    from ktinject.injection import pack_cache as packcache
    monkeypatch.delenv("KTINJECT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = packcache.cache_root(None, Path(demo.demo_model_dir()), worth_it=True)
    assert root == tmp_path / "xdg" / "ktinject" / "packed"
    assert packcache.cache_root(None, tmp_path, worth_it=True) == tmp_path / ".ktinject-cache"
    assert packcache.cache_root(False, Path(demo.demo_model_dir()), worth_it=True) is None
