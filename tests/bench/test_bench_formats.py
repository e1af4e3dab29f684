"""The release-format checkpoints of ``bench load --format`` (``ktinject.bench.checkpoints``, ``bench.gguf_file``) at
tiny shapes, and the benches that read them (``bench load``'s table, ``bench decode --checkpoint``).

Each written checkpoint must load through ``ktinject.from_pretrained`` as the model its own bytes describe: the
oracle is a float32 HF model holding the file's values dequantized here (FP8: e4m3 x its block's scale; GGUF:
``gguf.quants.dequantize``, names from gguf-py's ``TensorNameMap``), not by ktinject's readers. Non-expert tensors
equal those values exactly; the logits lie within each expert format's error (bounds on max |logits - oracle| /
max |oracle|: bf16 0.03, fp8 as fp8 0.03 or as int8 0.08, Q8_0 / Q6_K into int8 0.08, Q4_0 into int4 group 32 (its
values exactly, W4A8) 0.08; Q4_K_M, whose default int4 rounds its values again (logits within ~0.33), is checked in
int8, 0.08). The GGUF files are read by gguf's own reader with the types
llama.cpp's mixes give. Legend: E experts, H hidden, I expert intermediate, L layers.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import ktinject  # noqa: E402
from ktinject.bench import checkpoints as ck  # noqa: E402
from ktinject.bench import decode, gguf_file, load  # noqa: E402
from ktinject.bench import llamacpp as peer  # noqa: E402
from ktinject.tiny_models import tiny_prompts  # noqa: E402

L = 2
TOL = {"bf16": 0.03, "fp8": 0.08, "gguf-q8_0": 0.08, "gguf-q4_0": 0.08, "gguf-q4_k_m": 0.08, "gguf-q6_k": 0.08}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench-formats")
    return {f: ck.ensure(base, f, L, tiny=True, log=lambda s: None) for f in ck.FORMATS}


def _load(path, quant=None, **kw):
    return ktinject.from_pretrained(path, quant=quant, gpu="cpu", cache_dir=False, progress=False,
                                    dtype=torch.float32, **kw)


@torch.no_grad()
def _logits(model):
    return model(tiny_prompts(2, 9, seed=5)).logits


def _reference(state: dict):
    """A float32 HF model of the written config holding ``state`` (HF names, fused experts)."""
    from transformers import AutoModelForCausalLM

    config = ck.bench_config(L, tiny=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.eval()


def _safetensors_state(d):
    """The checkpoint's values, FP8 weights times their 128 x 128 block scales, per-expert keys fused."""
    from safetensors.torch import load_file

    raw = {}
    for f in sorted(d.glob("*.safetensors")):
        raw.update(load_file(f))
    out = {}
    for k, t in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw[k + "_scale_inv"]
            N, K = t.shape
            t = t.float() * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        out[k] = t.float()
    return _fuse(out)


def _fuse(state: dict) -> dict:
    E = ck.TINY["num_experts"]
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts."
        gate = [state.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
        up = [state.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
        state[p + "gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], 1)  # [E, 2I, H]
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(E)])  # [E, H, I]
    return state


def _gguf_state(path) -> tuple[dict, dict]:
    """(HF name -> float32 values by gguf's dequantize, GGUF name -> ggml type name)."""
    reader = gguf.GGUFReader(str(path))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, L)
    hf = {}
    for n in ("model.embed_tokens", "model.norm", "lm_head"):
        hf[names.get_name(n)] = n
    for i in range(L):
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate"):
            hf[names.get_name(f"model.layers.{i}.{n}")] = f"model.layers.{i}.{n}"
    state, types = {}, {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(shape)
        types[t.name] = t.tensor_type.name
        stem, leaf = t.name.rsplit(".", 1)
        if "_exps" in stem:
            state[t.name] = values
        else:
            state[f"{hf[stem]}.{leaf}"] = values
    for i in range(L):
        g, u, d = (state.pop(f"blk.{i}.ffn_{w}_exps.weight") for w in ("gate", "up", "down"))
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([g, u], 1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = d
    return state, types


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's use_more_bits (C integer division), written out again
    return i < math.floor(n / 8) or i >= math.floor(7 * n / 8) or (i - math.floor(n / 8)) % 3 == 2


@pytest.mark.parametrize("fmt", ck.FORMATS)
def test_every_format_loads_as_the_values_it_stores(written, fmt):
    c = written[fmt]
    state, _ = _gguf_state(c.path) if fmt in ck.GGUF else (_safetensors_state(c.path), None)
    ref = _reference(state)
    model = _load(c.path, quant="int8" if fmt == "gguf-q4_k_m" else None)
    stats = model._ktinject_load_stats
    assert stats["bytes_read"] >= 0.95 * c.nbytes and c.layer_bytes > 0
    got, want = model.state_dict(), ref.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.v_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert torch.equal(got[name], want[name]), name
    want_logits = _logits(ref)
    err = float((_logits(model) - want_logits).abs().max() / want_logits.abs().max())
    assert err < TOL[fmt], (fmt, err, stats["experts"])


def test_fp8_is_laid_out_as_the_releases(written):
    from safetensors import safe_open

    d = written["fp8"].path
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    H, I = ck.TINY["hidden_size"], ck.TINY["moe_intermediate_size"]
    with safe_open(d / index["model.layers.0.mlp.experts.7.down_proj.weight"], "pt") as f:
        w, s = f.get_tensor("model.layers.0.mlp.experts.7.down_proj.weight"), \
            f.get_tensor("model.layers.0.mlp.experts.7.down_proj.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and w.shape == (H, I) and s.dtype == torch.float32
    assert s.shape == (H // 128, I // 128) and torch.isfinite(w.float()).all()
    fp8 = {k for k in index if k.endswith("_scale_inv")}
    assert "model.layers.1.self_attn.q_proj.weight_scale_inv" in fp8
    assert not any(("embed" in k or "lm_head" in k or "norm" in k or "mlp.gate." in k) for k in fp8)


@pytest.mark.parametrize("fmt", ck.GGUF)
def test_gguf_has_llama_cpp_metadata_and_types(written, fmt):
    reader = gguf.GGUFReader(str(written[fmt].path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe" and field("qwen3moe.block_count") == L
    assert field("qwen3moe.expert_count") == ck.TINY["num_experts"]
    assert field("qwen3moe.expert_feed_forward_length") == ck.TINY["moe_intermediate_size"]
    assert field("tokenizer.ggml.model") == "gpt2" and len(field("tokenizer.ggml.tokens")) == ck.TINY["vocab_size"]
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    main = {"gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0", "gguf-q4_k_m": "Q4_K", "gguf-q6_k": "Q6_K"}[fmt]
    assert types["output.weight"] == ("Q8_0" if fmt == "gguf-q8_0" else "Q6_K")
    assert types["token_embd.weight"] == main and types["output_norm.weight"] == "F32"
    for i in range(L):
        more = "Q6_K" if fmt == "gguf-q4_k_m" and _more_bits(i, L) else main
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == types[f"blk.{i}.attn_q.weight"] == main
        assert types[f"blk.{i}.ffn_down_exps.weight"] == types[f"blk.{i}.attn_v.weight"] == more
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert [gguf_file.use_more_bits(i, 12) for i in range(12)] == [_more_bits(i, 12) for i in range(12)]
    assert [i for i in range(12) if gguf_file.use_more_bits(i, 12)] == [0, 3, 6, 9, 10, 11]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q6_K", "F16"])
def test_random_blocks_have_the_deviation_asked(qtype):
    b = gguf_file.random_blocks(qtype, 512, 0.02, np.random.default_rng(0))
    v = gguf.quants.dequantize(b.reshape(-1), gguf.GGMLQuantizationType[qtype])
    assert np.isfinite(v).all() and abs(float(v.std()) / 0.02 - 1) < 0.1 and abs(float(v.mean())) < 0.003  # (Q4_0: -d/2)


def test_ensure_reuses_a_checkpoint_of_the_same_shapes_only(tmp_path):
    said = []
    a = ck.ensure(tmp_path, "gguf-q4_0", 1, tiny=True, log=said.append)
    b = ck.ensure(tmp_path, "gguf-q4_0", 1, tiny=True, log=said.append)
    assert a == b and said[1].startswith("gguf-q4_0: reusing")
    c = ck.ensure(tmp_path, "gguf-q4_0", 2, tiny=True, log=said.append)
    assert "wrote" in said[2] and c.nbytes > a.nbytes
    with pytest.raises(SystemExit, match="expected a comma-separated list of bf16, fp8"):
        ck.parse_formats("bf16,gguf-q5_k")


def test_load_bench_prints_format_bound_and_ratio(tmp_path, monkeypatch, capsys):
    """bench load --format on tiny shapes, its loads in this process (the subprocess is the only difference)."""
    monkeypatch.setattr(load, "_run_child", lambda phase, d, cache, warm, quant: load.child(phase, d, cache, quant))
    assert load.main(["--format", "bf16,gguf-q4_0", "--tiny", "--layers", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bf16        stream" in out and "gguf-q4_0   stream" in out and "cold+cache" not in out
    assert "bound (host + one layer" in out and "experts int4 (groups of 32) (the release's); checkpoint gguf Q4_0" in out
    assert "gguf-q4_0 / bf16 (stream): " in out and "(target: within 1.5x: " in out
    assert not ck.path_of(tmp_path, "gguf-q4_0").exists()  # no --keep


def test_ratio_rows_judge_gguf_against_safetensors():
    r = lambda s, gb: {"seconds": s, "bytes_read": gb * 1e9}  # noqa: E731
    rows = load.ratio_rows({"bf16": {"stream": r(2.0, 4.0)}, "gguf-q4_k_m": {"stream": r(1.4, 2.0)},
                            "gguf-q8_0": {"stream": r(0.5, 2.0)}})
    assert rows == ["gguf-q4_k_m / bf16 (stream): 0.70 / 0.50 s per GB read = 1.40x  (target: within 1.5x: met)",
                    "gguf-q8_0 / bf16 (stream): 0.25 / 0.50 s per GB read = 0.50x  (target: within 1.5x: met)"]
    assert "NOT met" in load.ratio_rows({"fp8": {"stream": r(1.0, 1.0)}, "gguf-q6_k": {"stream": r(2.0, 1.0)}})[0]


def test_decode_bench_runs_a_checkpoint(written, capsys):
    path = str(written["gguf-q4_k_m"].path)
    assert decode.main(["--checkpoint", path, "--tokens", "2", "--hf-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert f"# checkpoint {path}: gguf Q4_K, gguf Q6_K; experts int4 (groups of 32) (the release's)" in out
    assert "| ktinject eager" in out and f"quant the release's, checkpoint {path})" in out and "hf:" not in out
    with pytest.raises(SystemExit, match="--checkpoint and --tiny"):
        decode.main(["--checkpoint", path, "--tiny"])


def test_peer_on_the_same_file_is_compared_unscaled(tmp_path, written):
    from tests.bench.test_bench_peer import ECHO, _args, _fake

    path = str(written["gguf-q8_0"].path)  # the fake llama-bench calls it Q8_0; ktinject ran int4 (an override)
    ours = {"int4": ("ktinject graph", 240.0)}
    args = _args(peer=_fake(tmp_path, ECHO), peer_model=path, layers=L, checkpoint=path)
    assert peer.same_file(args) and not peer.same_file(_args(peer_model=path, checkpoint=None))
    rows = {r[0]: r for r in decode.peer_rows(args, ours)}
    ratio = rows["int4 / llama.cpp Q8_0 -ot exps=CPU"]
    assert ratio[1] == "8.00x" and "the file ktinject loaded" in ratio[3] and "/48" not in ratio[3]
    rows = {r[0]: r for r in decode.peer_rows(_args(peer=args.peer, peer_model=path, layers=L), ours)}
    assert "no Q4_0 GGUF among --peer-model" in rows["int4 / llama.cpp"][3]


# ---- qwen35moe (bench.gguf_qwen35): the Qwen3.5-MoE GGUF llama-bench times -----------------------------------
def test_qwen35moe_gguf_has_llama_cpp_keys_tensors_and_types(tmp_path):
    from ktinject.bench import gguf_qwen35

    c = ck.ensure(tmp_path, "gguf-q4_k_m", 8, tiny=True, log=lambda s: None, shapes="qwen3_5_moe")
    reader = gguf.GGUFReader(str(c.path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    t = ck.TINY_QWEN3_5
    assert field("general.architecture") == "qwen35moe" and field("qwen35moe.block_count") == 8
    assert field("qwen35moe.full_attention_interval") == 4 and field("qwen35moe.expert_count") == t["num_experts"]
    assert field("qwen35moe.expert_shared_feed_forward_length") == t["shared_expert_intermediate_size"]
    assert field("qwen35moe.ssm.state_size") == t["linear_key_head_dim"]
    assert field("qwen35moe.ssm.group_count") == t["linear_num_key_heads"]
    assert field("qwen35moe.ssm.time_step_rank") == t["linear_num_value_heads"]
    assert field("qwen35moe.ssm.inner_size") == t["linear_num_value_heads"] * t["linear_value_head_dim"]
    assert field("qwen35moe.rope.dimension_count") == t["head_dim"] // 4
    assert field("qwen35moe.rope.dimension_sections") == [11, 11, 10, 0]
    assert field("tokenizer.ggml.pre") == "qwen35" and len(field("tokenizer.ggml.tokens")) == t["vocab_size"]
    got = {x.name: (x.tensor_type.name, tuple(int(d) for d in x.shape)) for x in reader.tensors}  # shape: ggml ne
    H, E, key = t["hidden_size"], t["num_experts"], t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value, nv = t["linear_num_value_heads"] * t["linear_value_head_dim"], t["linear_num_value_heads"]
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    assert got["blk.0.attn_qkv.weight"] == ("Q6_K", (H, 2 * key + value))  # layer 0: use_more_bits
    assert got["blk.1.attn_qkv.weight"] == ("Q4_K", (H, 2 * key + value))
    assert got["blk.1.attn_gate.weight"] == ("Q4_K", (H, value))
    assert got["blk.1.ssm_conv1d.weight"] == ("F32", (4, 2 * key + value))
    assert got["blk.1.ssm_a"] == got["blk.1.ssm_dt.bias"] == ("F32", (nv,))
    assert got["blk.1.ssm_alpha.weight"] == got["blk.1.ssm_beta.weight"] == ("Q4_K", (H, nv))
    assert got["blk.1.ssm_out.weight"] == ("Q4_K", (value, H)) and got["blk.1.ssm_norm.weight"][0] == "F32"
    assert "blk.1.attn_q.weight" not in got and "blk.3.attn_qkv.weight" not in got
    assert got["blk.3.attn_q.weight"] == ("Q4_K", (H, 2 * q)) and got["blk.3.attn_v.weight"] == ("Q6_K", (H, kv))
    assert got["blk.3.attn_output.weight"] == ("Q4_K", (q, H)) and got["blk.3.attn_q_norm.weight"][0] == "F32"
    assert got["blk.4.ffn_down_exps.weight"] == ("Q4_K", (t["moe_intermediate_size"], H, E))
    assert got["blk.7.ffn_down_exps.weight"][0] == got["blk.7.ffn_down_shexp.weight"][0] == "Q6_K"
    assert got["blk.4.ffn_gate_inp.weight"] == ("F32", (H, E))
    assert got["blk.4.ffn_gate_inp_shexp.weight"] == ("F32", (H,))
    assert got["blk.4.post_attention_norm.weight"][0] == "F32" and got["output.weight"][0] == "Q6_K"
    a = reader.get_tensor(next(i for i, x in enumerate(reader.tensors) if x.name == "blk.1.ssm_a"))
    assert (np.asarray(a.data) == -1).all()  # -exp(A_log): a decay in (0, 1)
    assert sum(x.n_bytes for x in reader.tensors) == c.nbytes
    assert c.nbytes == ck.estimate_bytes("gguf-q4_k_m", 8, True, "qwen3_5_moe")
    names = [x.name for x in reader.tensors]
    assert names == [x.name for x in gguf_qwen35.plan(ck.bench_config(8, True, "qwen3_5_moe"), "gguf-q4_k_m")]
    with pytest.raises(SystemExit, match="multiple of 4"):
        ck.ensure(tmp_path, "gguf-q4_0", 6, tiny=True, shapes="qwen3_5_moe")
    with pytest.raises(SystemExit, match="--format bf16 is not written"):
        ck.ensure(tmp_path, "bf16", 4, tiny=True, shapes="qwen3_5_moe")


def test_types_fall_back_as_llama_quantize_does():
    assert [gguf_file.fitted(t, 384) for t in ("Q4_K", "Q6_K", "Q4_0", "Q8_0")] == ["Q5_0", "Q8_0", "Q4_0", "Q8_0"]
    assert [gguf_file.fitted(t, 272) for t in ("Q4_K", "Q6_K", "Q4_0", "F32")] == ["F16", "F16", "F16", "F32"]
    assert gguf_file.output_type("gguf-q4_k_m", 384) == "Q8_0" and gguf_file.output_type("gguf-q4_0", 272) == "F16"
    assert gguf_file.output_type("gguf-q4_0", 2048) == "Q6_K" and gguf_file.output_type("gguf-q8_0", 256) == "Q8_0"


def test_load_bench_writes_a_qwen35moe_gguf_for_the_peer_only(tmp_path, capsys):
    argv = ["--write-only", "--shapes", "qwen3_5_moe", "--tiny", "--format", "gguf-q4_0", "--dir", str(tmp_path)]
    assert load.main(argv) == 0
    assert "gguf-q4_0: wrote" in capsys.readouterr().out and ck.path_of(tmp_path, "gguf-q4_0").is_file()
    assert gguf.GGUFReader(str(ck.path_of(tmp_path, "gguf-q4_0"))).fields["qwen35moe.block_count"].contents() == 4
    with pytest.raises(SystemExit, match="add --write-only"):
        load.main(argv[1:])
    with pytest.raises(SystemExit, match="needs --dir"):
        load.main(argv[:-2])
