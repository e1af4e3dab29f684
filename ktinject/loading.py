"""Load checkpoints larger than RAM allows twice: build on the meta device, then stream tensors to where they end.

    from_pretrained(dir, rules, gpu=...)  =  config -> model on the meta device -> plan -> load_into(model, plan, dir)

``load_into(model, plan, checkpoint)``:
  index   read every shard's header (``checkpoint.Checkpoint``) and map each checkpoint key to a model tensor with
          transformers' own conversion rules (``get_model_conversion_mapping`` + ``rename_source_key``): per-expert
          keys (``...experts.7.gate_proj.weight``, Mixtral ``block_sparse_moe.experts.7.w1``) name the fused
          experts tensor, an expert and a part (gate/up). Missing / unexpected keys, shapes and dtypes are checked
          before a byte of data is read.
  stream  shard by shard, tensor by tensor in file order (a reader thread a bounded window ahead), each tensor
          straight to where it ends:
            routed-expert tensors -> cast as transformers would -> ``native.Experts.set`` per expert (a fused
                                     tensor is read one expert slice at a time): never a layer's HF-layout experts
            everything else       -> its plan device, replacing the meta tensor (tied tensors stay one tensor)
          an operator's module is built as soon as its last tensor arrived (moe: a HybridMoE around the native
          experts filled here; other operators: their own ``build`` on the materialized module).
  cache   packed experts per MoE block (``packcache.PackCache``): a warm start reads those instead of the
          checkpoint's expert tensors and skips the repacking.
  finish  non-persistent buffers (rotary ``inv_freq``) recomputed on their device by the model's ``_init_weights``;
          no meta tensor may remain; one log line: seconds, GB/s, bytes per device.

Peak host memory: the final resident size plus the read-ahead window (``KTINJECT_READAHEAD_MB``, default 256) plus
one tensor's dtype conversion. Legend: E experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ktinject.checkpoint import (
    ST_DTYPES, BufferPool, Checkpoint, LoadError, Piece, ReadJob, check_expert_piece, check_quantization,
    expert_matrices, map_checkpoint)
from ktinject.packcache import PackCache
from ktinject import packcache

log = logging.getLogger(__name__)

__all__ = ["from_pretrained", "load_into", "LoadError"]

#: tensors of an HF experts module that go to native experts (both layouts)
EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_CPU = torch.device("cpu")


def from_pretrained(path, rules=None, quant: str | None = None, *, dtype: torch.dtype | str | None = None,
                    cache_dir=None, progress: bool = True, **devices) -> nn.Module:
    """A ready model from a local checkpoint directory, loaded without ever holding it twice.

    ``rules``: rule file / parsed rules / None (packaged rules of ``config.model_type``); ``quant``: expert
    quantization for every MoE block (``bf16``, ``int8``, ``int4``; None keeps the rules' choice, bf16 by default);
    ``dtype``: model dtype (default: the config's, as transformers); ``cache_dir``: packed-expert cache: a
    directory, True (``$KTINJECT_CACHE`` or ``<dir>/.ktinject-cache``), False (none), or None: that default
    place, but only for quantized (int8, int4) experts, where it saves time (see ``ktinject.packcache``);
    ``devices``: device variables (``gpu="cuda:0"``, ``gpu="cpu"``). The plan is ``model._ktinject_plan``, load
    figures ``model._ktinject_load_stats``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ktinject.plan import plan

    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path} is not a checkpoint directory (config.json + *.safetensors)")
    config = AutoConfig.from_pretrained(path)
    check_quantization(config, path)
    dtype = _model_dtype(config, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    the_plan = plan(model, rules, quant=quant, **devices)
    load_into(model, the_plan, path, cache_dir=cache_dir, progress=progress)
    return model


def load_into(model: nn.Module, plan, checkpoint, *, cache_dir=None, progress: bool = True, **hot):
    """Fill a meta-device ``model`` from ``checkpoint`` (a directory or one .safetensors file) following ``plan``
    (made from this model): operators built and tensors on their devices, as ``inject`` leaves a loaded model.
    ``hot``: inject's hot-expert settings (gpu_experts_budget, placement, stats). Returns the plan (also set as
    ``model._ktinject_plan``)."""
    if getattr(model, "_ktinject_plan", None) is not None:
        raise LoadError(f"{type(model).__name__} was already injected; load into a fresh meta-device model")
    ckpt = Checkpoint(Path(checkpoint))
    if getattr(model, "config", None) is not None:
        check_quantization(model.config, ckpt.dir)
    try:
        _Loader(model, plan, ckpt, cache_dir, progress).run()
    except LoadError as e:
        if not plan.unmatched_rules:
            raise
        from ktinject.plan import unmatched_note

        notes = "; ".join(unmatched_note(rule, model) for rule in plan.unmatched_rules)
        raise LoadError(f"{notes}\nbecause of that, loading failed: {e}") from e
    from ktinject.inject import finish

    finish(model, plan, **hot)
    return plan


def _model_dtype(config, dtype) -> torch.dtype:
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise LoadError(f"dtype {dtype!r} is not a floating torch dtype")
    return dtype


# ---------------------------------------------------------------------------------------------- loading


def _unit_of(name: str, units: dict[str, Any]) -> str | None:
    """The operator entry whose subtree holds the tensor ``name`` (longest prefix), or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in units:
            return prefix
    return None


class _Unit:
    """An operator entry being filled: reads left, and for moe its block spec and native experts."""

    def __init__(self, entry, module: nn.Module):
        self.entry, self.module = entry, module
        self.left, self.done, self.from_cache = 0, False, False
        self.spec = self.experts = None
        if entry.operator == "moe":
            from ktinject.operators.families import inspect_block

            self.spec = inspect_block(module, entry.name)

    @property
    def quant(self) -> str:
        return self.entry.kwargs.get("quant") or "bf16"


class _Loader:
    """State of one load_into call."""

    def __init__(self, model: nn.Module, plan, ckpt: Checkpoint, cache_dir, progress: bool):
        self.model, self.plan, self.ckpt, self.progress = model, plan, ckpt, progress
        if any(not e.name for e in plan.operator_entries()):
            raise LoadError("a rule replaces the root module; replace a submodule instead")
        self.units = {e.name: _Unit(e, model.get_submodule(e.name)) for e in plan.operator_entries()}
        # every original tensor stays referenced until the end: the id()-keyed maps below stay valid
        self.keep = [*model.parameters(), *model.buffers()]
        self.owners = _owners(model)
        self.devices = self._tensor_devices()
        self.pieces = map_checkpoint(model, ckpt, self._is_expert, lambda n: _unit_of(n, self.units))
        for piece in self.pieces:
            if piece.expert_leaf is not None:
                check_expert_piece(self.units[piece.unit].spec, piece)
        self.dtypes = _target_dtypes(model)
        self.resident: Counter[str] = Counter()
        self.bytes_read = 0
        self.cache = self._cache(cache_dir)
        self.hit = self.cache is not None and self.cache.hit

    def _tensor_devices(self) -> dict[int, torch.device]:
        out: dict[int, torch.device] = {}
        for name, device in self.plan.tensor_devices.items():
            mod_name, _, key = name.rpartition(".")
            mod = self.model.get_submodule(mod_name)
            t = mod._parameters[key] if key in mod._parameters else mod._buffers[key]
            out[id(t)] = torch.device(device)
        for unit in self.units.values():
            for t in (*unit.module.parameters(), *unit.module.buffers()):
                out.setdefault(id(t), torch.device(unit.entry.device))
        return out

    def _is_expert(self, target: str) -> tuple[str, str] | None:
        unit = _unit_of(target, self.units)
        if unit is None or self.units[unit].entry.operator != "moe":
            return None
        rest = target[len(unit) + 1:]
        leaf = rest[len("experts."):]
        return (unit, leaf) if rest.startswith("experts.") and leaf in EXPERT_LEAVES else None

    def _cache(self, cache_dir) -> PackCache | None:
        moe = {n: u for n, u in self.units.items() if u.entry.operator == "moe"}
        worth_it = any(u.quant != "bf16" for u in moe.values())
        root = packcache.cache_root(cache_dir, self.ckpt.dir, worth_it) if moe else None
        if root is None:
            return None
        from ktinject import native

        rules = sorted({repr(_rule_content(e.rule)) for e in self.plan.entries}
                       | {repr(_rule_content(r)) for r in self.plan.unmatched_rules})
        version = getattr(native, "version", None)
        key = packcache.cache_key(
            files=packcache.file_signature(self.ckpt.signature_files()), rules=rules,
            blocks={n: [repr(u.spec), u.quant] for n, u in moe.items()},
            native=version() if callable(version) else repr(version))
        return PackCache(root, key, self.ckpt.dir)

    # -- run

    def run(self) -> None:
        from tqdm.auto import tqdm

        from ktinject.operators.families import packed_nbytes

        jobs = self._jobs()
        moe = [u for u in self.units.values() if u.spec is not None]
        total = sum(j.nbytes for j in jobs) + sum(packed_nbytes(u.spec, u.quant) for u in moe if u.from_cache)
        writing = self.cache is not None and not self.hit and self.cache.begin(
            sum(packed_nbytes(u.spec, u.quant) for u in moe))
        window = int(os.environ.get("KTINJECT_READAHEAD_MB", "256")) << 20
        t0 = time.perf_counter()
        self.bar = bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                              disable=not self.progress, leave=False)
        self.packer, self.buffers = _Packer(), BufferPool(limit=window)
        try:
            with torch.no_grad():
                for job, buf in self.ckpt.stream(jobs, window, self.buffers):
                    self._dispatch(job, buf)
                    del buf
                    bar.update(job.nbytes)
                for unit in self.units.values():  # units with nothing left to read (all from the cache)
                    if not unit.done:
                        self._finish_unit(unit)
                self._init_buffers(self.model, "")
            self._check_no_meta()
            if writing:
                self.cache.commit({"blocks_total": len(moe)})
        except BaseException:
            if writing:
                self.cache.abort()
            raise
        finally:
            self.packer.close()
            bar.close()
        self._report(time.perf_counter() - t0, writing)

    def _jobs(self) -> list[ReadJob]:
        """Read jobs in file order (a fused experts tensor: one per expert); none for experts the cache has."""
        for name, unit in self.units.items():
            unit.from_cache = self.hit and unit.spec is not None and self.cache.has(name)
        jobs = []
        for piece in self.pieces:
            unit = self.units.get(piece.unit) if piece.unit is not None else None
            if piece.expert_leaf is not None and unit.from_cache:
                continue
            ref = piece.ref
            if piece.expert_leaf is not None and piece.expert is None:  # [E, ...]: expert slices
                step = ref.nbytes // ref.shape[0]
                new = [ReadJob((piece, e, ref.shape[1:]), ref.file, ref.offset + e * step, step, reuse=True)
                       for e in range(ref.shape[0])]
            else:  # the read buffer is reused unless it becomes the tensor itself (same dtype, on the CPU)
                copied = (self.devices.get(id(piece.meta), _CPU).type != "cpu"
                          or ST_DTYPES[ref.dtype] != self.dtypes.get(piece.target, piece.meta.dtype))
                new = [ReadJob((piece, piece.expert, ref.shape), ref.file, ref.offset, ref.nbytes,
                               reuse=piece.expert_leaf is not None or copied)]
            jobs.extend(new)
            if unit is not None:
                unit.left += len(new)
        return jobs

    def _dispatch(self, job: ReadJob, buf: torch.Tensor) -> None:
        piece, expert, shape = job.what
        x = buf.view(ST_DTYPES[piece.ref.dtype]).view(shape)
        dtype = self.dtypes.get(piece.target, piece.meta.dtype)  # as transformers would hold it
        self.bytes_read += job.nbytes
        if piece.expert_leaf is not None:
            unit = self.units[piece.unit]
            if unit.experts is None:
                unit.experts = _new_experts(unit)
            self.packer.submit(_pack, unit.experts, unit.spec, piece, expert, x.to(dtype), buf, self.buffers)
        else:
            self._assign(piece.meta, x.to(device=self.devices.get(id(piece.meta), _CPU), dtype=dtype))
            if job.reuse:  # copied (synchronously) to another device or dtype
                self.buffers.put(buf)
        if piece.unit is not None:
            unit = self.units[piece.unit]
            unit.left -= 1
            if unit.left == 0:
                self._finish_unit(unit)

    def _assign(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """Put ``value`` wherever the model holds ``meta`` (every owner of a tied tensor gets the same one)."""
        param = nn.Parameter(value, requires_grad=False) if isinstance(meta, nn.Parameter) else None
        for mod, key, is_param in self.owners[id(meta)]:
            (mod._parameters if is_param else mod._buffers)[key] = param if is_param else value
        self.resident[str(value.device)] += value.numel() * value.element_size()

    def _finish_unit(self, unit: _Unit) -> None:
        from ktinject import operators

        unit.done = True
        entry = unit.entry
        self.packer.drain()  # every set() of this block has run
        self._init_buffers(unit.module, entry.name)
        if unit.spec is not None:
            if unit.experts is None:
                unit.experts = _new_experts(unit)
            if unit.from_cache:
                n = self.cache.load(entry.name, unit.experts)
                self.bytes_read += n
                self.bar.update(n)
            elif self.cache is not None and self.cache.writing:
                self.cache.put(entry.name, unit.experts)
            new = _hybrid(unit)
            self.resident["cpu"] += unit.experts.nbytes
        else:
            new = operators.get(entry.operator).build(unit.module, entry.name, entry.kwargs, entry.device)
        if new is not unit.module:
            parent, _, leaf = entry.name.rpartition(".")
            setattr(self.model.get_submodule(parent), leaf, new)
        unit.module = unit.experts = None

    def _init_buffers(self, root: nn.Module, prefix: str) -> None:
        """Materialize non-persistent meta buffers under ``root`` on their devices; recompute them with the
        model's ``_init_weights`` (transformers' own recipe, e.g. rotary inv_freq from the config)."""
        for mod_name, mod in root.named_modules(prefix=prefix):
            names = [k for k, b in mod._buffers.items()
                     if b is not None and b.is_meta and k in mod._non_persistent_buffers_set]
            if not names:
                continue
            for key in names:
                meta = mod._buffers[key]
                self._assign(meta, torch.empty_like(meta, device=self.devices.get(id(meta), "cpu")))
            for key, t in (*mod._parameters.items(), *mod._buffers.items()):
                if t is not None and key not in names:
                    t._is_hf_initialized = True  # transformers' init functions leave loaded tensors alone
            self.model._init_weights(mod)

    def _check_no_meta(self) -> None:
        left = [n for n, t in (*self.model.named_parameters(), *self.model.named_buffers()) if t.is_meta]
        if left:
            raise LoadError(f"{len(left)} tensors were not loaded (still on the meta device), e.g. "
                            f"{', '.join(left[:5])}: the checkpoint {self.ckpt.dir} does not cover this model")

    def _report(self, seconds: float, wrote: bool) -> None:
        gbs = self.bytes_read / max(seconds, 1e-9) / 1e9
        per_device = ", ".join(f"{d} {b / 1e9:.3f} GB" for d, b in sorted(self.resident.items()))
        cache = "hit" if self.hit else ("written" if wrote else "off")
        self.model._ktinject_load_stats = {
            "seconds": seconds, "bytes_read": self.bytes_read, "gb_per_s": gbs, "resident": dict(self.resident),
            "cache": cache, "cache_dir": str(self.cache.dir) if self.cache is not None else None,
        }
        log.info("loaded %s in %.2f s: %.3f GB read, %.2f GB/s; resident %s; packed-expert cache: %s",
                 self.ckpt.dir, seconds, self.bytes_read / 1e9, gbs, per_device, cache)


class _Packer:
    """Runs packing jobs on a few threads (native set() releases the GIL and is thread-safe for different
    (expert, matrix)); at most 2 jobs per thread in flight, so the memory they hold stays small."""

    def __init__(self):
        from ktinject import native

        workers = int(os.environ.get("KTINJECT_PACK_THREADS", "0")) or max(1, min(16, native.physical_cores()))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ktinject-pack") if workers > 1 else None
        self.pending: deque = deque()
        self.limit = 2 * workers

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            fn(*args)
            return
        while len(self.pending) >= self.limit:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True)
            self.pending.clear()


def _pack(experts, spec, piece: Piece, expert: int, x: torch.Tensor, buf: torch.Tensor, buffers) -> None:
    """Pack one expert's slice ``x`` of ``piece`` into native ``experts``; then give the read buffer back."""
    for which, w in expert_matrices(spec, piece, x):
        try:
            if which.endswith("_bias"):
                experts.set_bias(expert, which[:-5], w)
            else:
                experts.set(expert, which, w)
        except Exception as e:
            raise LoadError(f"tensor {piece.ref.key!r} in {piece.ref.file}: packing expert {expert} ({which}) "
                            f"of {piece.unit!r} failed: {e}") from e
    buffers.put(buf)  # set() copied what it needed


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (module, key, is_parameter) holding it (tied tensors have several)."""
    out: dict[int, list] = {}
    for mod in model.modules():
        for is_param, store in ((True, mod._parameters), (False, mod._buffers)):
            for key, t in store.items():
                if t is not None:
                    out.setdefault(id(t), []).append((mod, key, is_param))
    return out


def _new_experts(unit: _Unit):
    from ktinject import native

    s, ex = unit.spec, unit.module.experts
    return native.Experts(s.num_experts, s.hidden, s.intermediate, quant=unit.quant,
                          activation="gptoss" if s.layout == "gpt_oss" else "silu",
                          alpha=float(getattr(ex, "alpha", 1.702)), limit=float(getattr(ex, "limit", 7.0)),
                          bias=s.has_bias)


def _hybrid(unit: _Unit) -> nn.Module:
    """The moe operator's module around native experts filled here; router and shared experts are already on the
    entry's device and the block's experts module (still meta) is dropped with the block."""
    from ktinject.operators.moe import HybridMoE

    hybrid = HybridMoE(unit.module, unit.spec, unit.experts, unit.entry.device, unit.quant)
    hybrid.train(unit.module.training)
    return hybrid


def _rule_content(rule) -> tuple:
    return (rule.match_name, rule.match_class, rule.replace, sorted((k, repr(v)) for k, v in rule.kwargs.items()),
            rule.device, rule.recursive)


def _target_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Tensor name -> dtype transformers' from_pretrained gives it where that differs from the meta model's
    (``_keep_in_fp32_modules_strict`` of bf16/fp16 models, e.g. DeepSeek-V3's e_score_correction_bias)."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    try:
        dtype_plan = model._get_dtype_plan(dtype) if isinstance(dtype, torch.dtype) else {}
    except Exception:  # noqa: BLE001 - private API of transformers
        dtype_plan = {}
    patterns = [(re.compile(p.replace("*", ".*")), d) for p, d in (dtype_plan or {}).items()]
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        for rx, d in patterns:
            if t.is_floating_point() and rx.search(name):
                out[name] = d
                break
    return out
