"""Load checkpoints larger than RAM allows twice: build on the meta device, then stream tensors to where they end.

    from_pretrained(dir, rules, gpu=...)  =  config -> model on the meta device -> plan -> load_into(model, plan, dir)

``load_into(model, plan, checkpoint)``:
  index   open the checkpoint's reader (``ktinject.injection.formats``: every shard's header) and map each checkpoint key to
          a model tensor with transformers' own conversion rules (``formats.hf_keys``): per-expert keys
          (``...experts.7.gate_proj.weight``, Mixtral ``block_sparse_moe.experts.7.w1``) name the fused experts
          tensor, an expert and a part (gate/up). Missing / unexpected keys, shapes and dtypes are checked before a
          byte of data is read.
  stream  shard by shard, tensor by tensor in file order (a reader thread a bounded window ahead), each tensor
          straight to where it ends:
            routed-expert tensors -> cast as transformers would -> ``native.Experts.set`` per expert (a fused
                                     tensor is read one expert slice at a time): never a layer's HF-layout experts;
                                     expert biases (gpt-oss) are also kept as float32 host copies
            everything else       -> its plan device, replacing the meta tensor (``apply.TensorOwners``: tied
                                     tensors stay one tensor)
          an operator's module is built as soon as its last tensor arrived, by ``apply.build_operator``: around the
          native experts filled here for operators with an ``expert_stream`` (moe), else from the materialized
          module, as ``inject`` builds it.
  cache   packed experts per MoE block (``packcache.PackCache``): a warm start reads those instead of the
          checkpoint's expert weights and skips the repacking (the tiny bias tensors are still read).
  finish  non-persistent buffers (rotary ``inv_freq``) recomputed on their device by the model's ``_init_weights``;
          no meta tensor may remain; then ``apply.finish`` (hot experts, generate); one log line: seconds, GB/s,
          bytes per device.

Peak host memory: the final resident size plus the read-ahead window (``KTINJECT_READAHEAD_MB``, default 256) plus
one tensor's dtype conversion. Legend: E experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ktinject import native, operators
from ktinject.injection import apply
from ktinject.injection import pack_cache as packcache
from ktinject import envs
from ktinject.injection.formats import open_checkpoint
from ktinject.injection.formats.base import BufferPool, LoadError, Reader, ReadJob
from ktinject.injection.formats.codecs import FP8Block
from ktinject.injection.model_dtypes import model_dtype, release_format, release_group, target_dtypes
from ktinject.injection.formats.hf_keys import Piece, check_expert_piece, convert_tensor, map_checkpoint
from ktinject.injection.requant import RequantError
from ktinject.injection.expert_packing import Packer, TensorBytes, pack_expert
from ktinject.gpu_experts.prefill.policy import mode_from_plan
from ktinject.gpu_experts.hot.budget import Workload
from ktinject.gpu_experts.hot.settings import HotExpertSettings
from ktinject.injection import gpu_budget
from ktinject.injection import lora as lora_merge
from ktinject.operators import fp8_linear
from ktinject.operators.families import empty_biases
from ktinject.injection.pack_cache import CorruptCache, PackCache
from ktinject.injection.plan import plan as make_plan, unmatched_note

log = logging.getLogger(__name__)

__all__ = ["from_pretrained", "load_into", "LoadError"]

_CPU = torch.device("cpu")


def from_pretrained(path, rules=None, quant: str | None = None, *, dtype: torch.dtype | str | None = None,
                    cache_dir=None, progress: bool = True, gpu_experts_budget=None, placement: str | None = None,
                    stats=None, rebalance_every: int | None = None, defer: int | float | None = None,
                    prefill: str | None = None, dense_fp8: str | None = None, prefix_cache=None,
                    gpu_memory=None, max_batch: int | None = None, max_context: int | None = None,
                    gpu_reserve=None, lora=None, **devices) -> nn.Module:
    """A ready model from a local checkpoint directory (or a GGUF file), loaded without ever holding it twice.

    ``rules``: rule file / parsed rules / None (packaged rules of ``config.model_type``); ``quant``: expert
    quantization for every MoE block (``bf16``, ``int8``, ``int4``, ``fp8``, ``mxfp4``; None keeps a quantized
    release's format (FP8 -> fp8, MXFP4 -> mxfp4, int4 -> int4), else the rules' choice, bf16 by default);
    ``dtype``: model dtype (default: the config's, as transformers); ``cache_dir``: packed-expert cache: a
    directory, True (``$KTINJECT_CACHE`` or ``<dir>/.ktinject-cache``), False (none), or None: that default
    place, but only for quantized (int8, int4, fp8, mxfp4) experts, where it saves time (see
    ``ktinject.injection.pack_cache``);
    ``gpu_experts_budget``, ``placement``, ``stats``, ``rebalance_every``: hot experts, as for ``inject``
    (``ktinject.gpu_experts.hot.settings``; the budget ``auto`` unless given); ``gpu_memory``, ``max_batch``,
    ``max_context``, ``gpu_reserve``: the GPU cap and what the budget leaves room for, as for ``inject`` (a
    ``prefix_cache``'s GPU tier is left room too); ``defer``: expert deferral in decode steps, as for ``inject``;
    ``prefill``: where prompts' routed experts run (``auto``, ``cpu``, ``gpu``), as for ``inject``;
    ``dense_fp8``: which FP8 linear weights of an FP8 release stay FP8 (``none``, the default: dequantized to
    ``dtype``; ``attention``, ``mlp``, ``all``: ``ktinject.operators.fp8_linear``);
    ``prefix_cache``: a ``ktinject.decode.prefix_cache.PrefixCache`` its generate uses, as for ``inject``;
    ``lora``: a PEFT LoRA adapter directory merged into the weights after the load, as for ``inject``;
    ``devices``: device variables (``gpu="cuda:0"``, ``gpu="cpu"``). The
    plan is ``model._ktinject_plan``, load figures ``model._ktinject_load_stats``."""
    from transformers import AutoConfig, GenerationConfig  # heavy: on the first load only

    path = Path(path)
    not_dir = LoadError(f"{path} is not a checkpoint directory (config.json + *.safetensors) or GGUF file")
    if not path.exists():
        raise not_dir
    adapter = None if lora is None else lora_merge.read_adapter(lora)  # a bad adapter fails before the load
    reader = open_checkpoint(path)
    config = reader.config()  # a GGUF's from its metadata; None: config.json
    if config is None:
        if not path.is_dir():
            raise not_dir
        config = AutoConfig.from_pretrained(path)
    reader.check_config(config)
    reader.config_checked = True
    # the model is built plain (its quantized tensors decode while they load): transformers must not swap in its
    # quantized modules for the config's quantization_config
    source_quant = getattr(config, "quantization_config", None)
    if source_quant is not None:
        del config.quantization_config
    dtype = model_dtype(config, dtype)
    with torch.device("meta"):
        model = _auto_class(config).from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    group_size = None
    if quant is None and rules is None:  # the packaged rules: keep the release's expert format
        quant, group_size = release_format(reader)
    elif rules is None:  # a format asked for: in the group that holds the release's values exactly, if one does
        group_size = release_group(reader, quant)
    the_plan = make_plan(model, rules, quant=quant, defer=defer, group_size=group_size, **devices)
    load_into(model, the_plan, reader, cache_dir=cache_dir, progress=progress, gpu_experts_budget=gpu_experts_budget,
              placement=placement, stats=stats, rebalance_every=rebalance_every, prefill=prefill, dense_fp8=dense_fp8,
              gpu_memory=gpu_memory, max_batch=max_batch, max_context=max_context,
              gpu_reserve=_with_prefix_tier(gpu_reserve, prefix_cache))
    if adapter is not None:
        lora_merge.merge_adapter(model, adapter)
    if prefix_cache is not None:
        from ktinject.decode.generate import attach_prefix_cache

        attach_prefix_cache(model, prefix_cache)
    return model


def _auto_class(config):
    """The transformers auto class whose model a checkpoint of ``config`` holds: a causal LM, or for image-text
    families without one (Kimi-K2.5) the image-text-to-text model (its language model is what ktinject injects)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) in AutoModelForCausalLM._model_mapping or type(config) not in \
            AutoModelForImageTextToText._model_mapping:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_into(model: nn.Module, plan, checkpoint, *, cache_dir=None, progress: bool = True,
              prefill: str | None = None, dense_fp8: str | None = None, gpu_memory=None,
              max_batch: int | None = None, max_context: int | None = None, gpu_reserve=None, **hot_options):
    """Fill a meta-device ``model`` from ``checkpoint`` (a directory, one .safetensors file, or an open
    ``formats.Reader``) following ``plan`` (made from this model): operators built and tensors on their devices,
    as ``inject`` leaves a loaded model. ``prefill``, ``gpu_memory``, ``max_batch``, ``max_context``, ``gpu_reserve``,
    ``hot_options``: the options of ``inject``; ``dense_fp8``: as for ``from_pretrained``. Returns the plan, with
    its GPU budget (also set as ``model._ktinject_plan``)."""
    if getattr(model, "_ktinject_plan", None) is not None:
        raise LoadError(f"{type(model).__name__} was already injected; load into a fresh meta-device model")
    apply.check_devices(plan)
    hot = HotExpertSettings.from_plan(plan, **hot_options)  # bad options fail before a byte is read
    workload = Workload.make(gpu_memory, max_batch, max_context, gpu_reserve)
    prefill = mode_from_plan(plan, prefill)
    try:
        fp8_kinds = fp8_linear.kinds_of(dense_fp8)
    except ValueError as e:
        raise LoadError(str(e)) from None
    reader = open_checkpoint(checkpoint)
    if getattr(model, "config", None) is not None and not reader.config_checked:  # (from_pretrained checked it)
        reader.check_config(model.config)
    gpu_budget.prepare(model, plan, workload)  # the cap holds from the first tensor on
    try:
        _Loader(model, plan, reader, cache_dir, progress, fp8_kinds).run()
    except LoadError as e:
        if not plan.unmatched_rules:
            raise
        notes = "; ".join(unmatched_note(rule, model) for rule in plan.unmatched_rules)
        raise LoadError(f"{notes}\nbecause of that, loading failed: {e}") from e
    hot, found = gpu_budget.resolve(model, plan, hot, workload, prefill)
    plan.record_budget(found)
    apply.finish(model, plan, hot, prefill)
    return plan


def _with_prefix_tier(gpu_reserve, prefix_cache):
    """``gpu_reserve`` plus the GPU tier of the prefix cache attached after the load (the budget leaves it room)."""
    tier = gpu_budget.prefix_cache_reserve(prefix_cache)
    if not tier:
        return gpu_reserve
    return tier + (0 if gpu_reserve is None else Workload.make(gpu_reserve=gpu_reserve).reserve)


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
    """An operator entry being filled: reads left; for operators with an ``expert_stream`` (moe) what to pack, and
    the native experts and biases filled here."""

    def __init__(self, entry, module: nn.Module):
        self.entry, self.module = entry, module
        self.left, self.done, self.from_cache = 0, False, False
        self.stream = operators.get(entry.operator).expert_stream(module, entry.name, entry.kwargs)
        self.experts = self.biases = None

    def start(self) -> None:
        """Empty native experts (and bias copies, gpt-oss) to fill, once."""
        if self.experts is None:
            self.experts = self.stream.new_experts(self.module)
            self.biases = empty_biases(self.stream.spec) if self.stream.spec.has_bias else None


class _Loader:
    """State of one load_into call."""

    def __init__(self, model: nn.Module, plan, ckpt: Reader, cache_dir, progress: bool, fp8_kinds=frozenset()):
        self.model, self.plan, self.ckpt, self.progress = model, plan, ckpt, progress
        self.fp8_kinds = fp8_kinds
        if any(not e.name for e in plan.operator_entries()):
            raise LoadError("a rule replaces the root module; replace a submodule instead")
        self.units = {e.name: _Unit(e, model.get_submodule(e.name)) for e in plan.operator_entries()}
        self.owners = apply.TensorOwners(model)  # holds every original tensor: the id()-keyed maps stay valid
        self.devices = apply.tensor_targets(model, plan.tensor_devices)
        for unit in self.units.values():  # an operator's subtree goes to the operator's device
            for t in (*unit.module.parameters(), *unit.module.buffers()):
                self.devices.setdefault(id(t), torch.device(unit.entry.device))
        self.pieces = map_checkpoint(model, ckpt, self._is_expert, lambda n: _unit_of(n, self.units))
        for piece in self.pieces:
            if piece.expert_leaf is not None:
                check_expert_piece(self.units[piece.unit].stream.spec, piece)
        self.dtypes = target_dtypes(model)
        self.resident: Counter[str] = Counter()
        self.bytes_read = 0
        self.cache = self._cache(cache_dir)
        self.hit = self.cache is not None and self.cache.hit
        self.repacked: list[str] = []  # blocks whose cached bytes failed their digest

    def _is_expert(self, target: str) -> tuple[str, str] | None:
        unit = _unit_of(target, self.units)
        stream = None if unit is None else self.units[unit].stream
        leaf = None if stream is None else stream.leaf(target[len(unit) + 1:])
        return None if leaf is None else (unit, leaf)

    def _cache(self, cache_dir) -> PackCache | None:
        moe = {n: u.stream for n, u in self.units.items() if u.stream is not None}
        worth_it = any(st.quant != "bf16" for st in moe.values())
        root = packcache.cache_root(cache_dir, self.ckpt.dir, worth_it) if moe else None
        if root is None:
            return None
        version = getattr(native, "version", None)
        origin = {"files": packcache.file_signature(self.ckpt.signature_files()),
                  "native": version() if callable(version) else repr(version)}
        # the packed bytes depend on the checkpoint, the native library and each block's spec, quant and group, not
        # on the rest of the rules (devices, hot experts, prefill, defer): editing those reuses the entry
        key = packcache.cache_key(**origin,
                                  blocks={n: [repr(st.spec), st.quant, st.group_size] for n, st in moe.items()})
        return PackCache(root, key, self.ckpt.dir, origin)

    # -- run

    def run(self) -> None:
        jobs = self._jobs()
        moe = [u for u in self.units.values() if u.stream is not None]
        total = sum(j.nbytes for j in jobs) + sum(u.stream.nbytes for u in moe if u.from_cache)
        writing = self.cache is not None and not self.hit and self.cache.begin(sum(u.stream.nbytes for u in moe))
        self.window = window = envs.get("KTINJECT_READAHEAD_MB") << 20
        t0 = time.perf_counter()
        self.bar = bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                              disable=not self.progress, leave=False)
        self.packer, self.buffers = Packer(), BufferPool(limit=window)
        self.requant = RequantError()
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
            if self.repacked:  # the next start writes a whole new entry
                self.cache.drop()
        except BaseException:
            if writing:
                self.cache.abort()
            raise
        finally:
            self.packer.close()
            bar.close()
        self._report(time.perf_counter() - t0, writing)

    def _jobs(self) -> list[ReadJob]:
        """Read jobs in file order (a fused experts tensor: one per expert); none for expert weights the cache has
        (their biases are read all the same: the packed bytes cannot give them back)."""
        for name, unit in self.units.items():
            unit.from_cache = self.hit and unit.stream is not None and self.cache.has(name)
        jobs = []
        for piece in self.pieces:
            unit = self.units.get(piece.unit) if piece.unit is not None else None
            if piece.expert_leaf is not None and unit.from_cache and not piece.expert_leaf.endswith("_bias"):
                continue
            new = self._piece_jobs(piece)
            jobs.extend(new)
            if unit is not None:
                unit.left += len(new)
        return jobs

    def _piece_jobs(self, piece: Piece) -> list[ReadJob]:
        ref = piece.ref
        if piece.expert_leaf is not None and piece.expert is None:  # [E, ...]: expert slices
            return [ReadJob((piece, e, ref.shape[1:]), ref.expert_spans(e), reuse=True) for e in range(ref.shape[0])]
        # the read buffer is reused unless it becomes the tensor itself (same dtype, on the CPU, not decoded)
        copied = (ref.codec is not None or piece.converted is not None or self.devices.get(id(piece.meta), _CPU).type != "cpu"
                  or self.ckpt.torch_dtype(ref) != self.dtypes.get(piece.target, piece.meta.dtype))
        return [ReadJob((piece, piece.expert, ref.shape), ref.all_spans(), reuse=piece.expert_leaf is not None or copied)]

    def _repack(self, unit: _Unit) -> None:
        """Pack ``unit``'s experts from the checkpoint after its cached block failed its digest (biases again too:
        from the cache they went to the float32 copies only)."""
        unit.from_cache = False
        jobs = [j for p in self.pieces if p.unit == unit.entry.name and p.expert_leaf is not None
                for j in self._piece_jobs(p)]
        self.bar.total += sum(j.nbytes for j in jobs) - unit.stream.nbytes  # (counted as the cache's bytes)
        for job, buf in self.ckpt.stream(jobs, self.window, self.buffers):
            self._submit_pack(unit, job, buf)
            self.bar.update(job.nbytes)
        self.packer.drain()

    def _submit_pack(self, unit: _Unit, job: ReadJob, buf: torch.Tensor) -> None:
        """Pack one read expert slice (decoded and packed on a packer thread); its bytes count as read."""
        piece, expert, shape = job.what
        self.bytes_read += job.nbytes
        unit.start()
        self.packer.submit(pack_expert, unit, piece, expert, TensorBytes(self.ckpt, piece.ref, buf, shape),
                           self.dtypes.get(piece.target, piece.meta.dtype), self.buffers, self.requant)

    def _dispatch(self, job: ReadJob, buf: torch.Tensor) -> None:
        piece, expert, shape = job.what
        if piece.expert_leaf is not None:
            self._submit_pack(self.units[piece.unit], job, buf)
        elif piece.converted is not None:  # one tensor transformers converts into several (e.g. q, k, v)
            self.bytes_read += job.nbytes
            x = TensorBytes(self.ckpt, piece.ref, buf, shape).values(self.dtypes.get(piece.target, piece.meta.dtype))
            for meta, value in convert_tensor(piece, x, self.model):
                device = self.devices.get(id(meta), _CPU)
                self._assign(meta, value.to(device=device, dtype=meta.dtype, copy=True))
            self.buffers.put(buf)
        elif self._keep_fp8(piece, buf, shape):
            self.bytes_read += job.nbytes
            self.buffers.put(buf)
        else:
            self.bytes_read += job.nbytes
            dtype = self.dtypes.get(piece.target, piece.meta.dtype)
            x = TensorBytes(self.ckpt, piece.ref, buf, shape).values(dtype)
            self._assign(piece.meta, x.to(device=self.devices.get(id(piece.meta), _CPU), dtype=dtype))
            if job.reuse:  # copied (synchronously) to another device or dtype
                self.buffers.put(buf)
        if piece.unit is not None:
            unit = self.units[piece.unit]
            unit.left -= 1
            if unit.left == 0:
                self._finish_unit(unit)

    def _keep_fp8(self, piece: Piece, buf: torch.Tensor, shape) -> bool:
        """An FP8 linear weight of a kept kind (``dense_fp8``): an ``FP8Linear`` of its bytes and scales takes the
        ``nn.Linear``'s place, on the weight's device. False for every other tensor."""
        codec = piece.ref.codec
        mod_name, _, leaf = piece.target.rpartition(".")
        if not self.fp8_kinds or not isinstance(codec, FP8Block) or leaf != "weight" or len(shape) != 2 or (
                fp8_linear.kind_of(mod_name) not in self.fp8_kinds):
            return False
        old = self.model.get_submodule(mod_name)
        if type(old) is not nn.Linear:
            return False
        device = self.devices.get(id(piece.meta), _CPU)
        weight, scale = codec.parts(buf, shape)
        new = fp8_linear.adopt(self.model, mod_name, weight.to(device, copy=True), scale.to(device, copy=True),
                               codec.block)  # (copies: the read buffer goes back to the pool)
        if old.bias is not None:  # filled later: the new module holds the same tensor
            self.owners.owners[id(old.bias)].append((new, "bias", True))
        self.resident[str(device)] += weight.numel() + scale.numel() * 4
        return True

    def _assign(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """Put ``value`` wherever the model holds ``meta`` (every owner of a tied tensor gets the same one)."""
        self.owners.replace(meta, value, requires_grad=False)
        self.resident[str(value.device)] += value.numel() * value.element_size()

    def _finish_unit(self, unit: _Unit) -> None:
        unit.done = True
        entry = unit.entry
        self.packer.drain()  # every set() of this block has run
        self._init_buffers(unit.module, entry.name)
        if unit.stream is None:
            apply.build_operator(self.model, entry, unit.module)
        else:
            unit.start()
            if unit.from_cache:
                try:
                    n = self.cache.load(entry.name, unit.experts)
                except CorruptCache as e:
                    log.warning("%s; packing block %r from the checkpoint instead (the entry is removed after this "
                                "load, the next one writes it anew)", e, entry.name)
                    self.repacked.append(entry.name)
                    self._repack(unit)
                else:
                    self.bytes_read += n
                    self.bar.update(n)
            elif self.cache is not None and self.cache.writing:
                self.cache.put(entry.name, unit.experts)
            self.resident["cpu"] += unit.experts.nbytes
            apply.build_operator(self.model, entry, unit.module, packed=(unit.experts, unit.biases))
        unit.module = unit.experts = unit.biases = None

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
        if self.repacked:
            cache = f"corrupted: {len(self.repacked)} blocks repacked"
        self.model._ktinject_load_stats = {
            "seconds": seconds, "bytes_read": self.bytes_read, "gb_per_s": gbs, "resident": dict(self.resident),
            "cache": cache, "cache_dir": str(self.cache.dir) if self.cache is not None else None,
            "formats": list(getattr(self.ckpt, "quant_formats", [])), "experts": self.requant.report(),
        }
        note = self.requant.describe()
        if note:
            log.warning("%s", note)
        log.info("loaded %s in %.2f s: %.3f GB read, %.2f GB/s; resident %s; packed-expert cache: %s",
                 self.ckpt.dir, seconds, self.bytes_read / 1e9, gbs, per_device, cache)
