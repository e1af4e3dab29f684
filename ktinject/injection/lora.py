"""LoRA adapters for inference: a PEFT-format adapter merged into the base weights of the modules it targets.

``inject(model, lora=DIR)`` and ``from_pretrained(..., lora=DIR)`` call ``merge_adapter`` once the model is built:
for every adapted ``nn.Linear`` (attention projections, dense MLPs, shared experts) its weight becomes
``W + scaling * B @ A`` (PEFT's own merge: the product in float32, added in place), so the decode step, its graph and
its kernels are those of the base model, with other numbers in the same tensors. Adapters of the routed experts
(``...mlp.experts.E.expert_gate_proj`` / ``expert_up_proj`` / ``expert_down_proj``, or transformers 4.x's per-expert
``gate_proj`` / ``up_proj`` / ``down_proj``) cannot be merged into packed int4 / int8 / fp8 experts without
requantizing them: they are applied on the CPU at every forward instead (``ktinject.operators.expert_lora``;
``save_merged`` refuses them). ``save_merged(base, adapter, out)``
writes the merged checkpoint: the base directory's files with the adapted tensors replaced, every other tensor (the
routed experts' included) copied byte for byte.

An adapter is a directory as ``PeftModel.save_pretrained`` writes it: ``adapter_config.json`` (``peft_type``
``LORA``) and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]. ``scaling`` is ``lora_alpha / r`` (``alpha_pattern`` per module; ``use_rslora``:
``/ sqrt(r)``). What cannot be merged is refused by name: DoRA, LoRA biases, ``modules_to_save``, embedding
adapters, ``target_parameters`` (LoRA on the routed experts' tensors), a module that is missing or is not a plain
linear layer (an FP8 one), shapes that differ from the model's.

The base model: ``ktinject finetune`` writes ``ktinject_base.json`` beside the adapter, a few sampled values of each
adapted base weight; where it is present they must match the model's (within bf16 rounding), else the adapter was
trained on other weights and is refused. Without it, a local ``base_model_name_or_path`` directory's config is
compared with the model's (architecture and sizes).
"""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ktinject.operators import expert_lora

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE_FILE = "ktinject_base.json"  # the base weights' fingerprint (written by ktinject finetune)
PREFIX = "base_model.model."
_SAMPLES = 16  # sampled values per base weight in the fingerprint
_CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
_UNSUPPORTED = {"use_dora": "DoRA adapters", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out (Conv1D)"}


class LoraError(ValueError):
    """An adapter that cannot be merged into this model; the message says why and what to use instead."""


@dataclass(frozen=True)
class LoraPair:
    """One adapted linear layer: A [r, in], B [out, r] and the scaling of their product."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def delta(self, device=None) -> torch.Tensor:
        """scaling * B @ A [out, in] in float32 (on ``device``)."""
        a, b = (t.to(device=device, dtype=torch.float32) for t in (self.a, self.b))
        return (b @ a) * self.scaling


@dataclass(frozen=True)
class Adapter:
    path: Path
    config: dict
    pairs: dict[str, LoraPair]  # module name (as in model.named_modules()) -> its adapter
    base: dict | None  # ktinject_base.json, or None


def read_adapter(path) -> Adapter:
    """The adapter in directory ``path``, checked for what merging supports (LoraError naming what is not)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoraError(f"{path} is not a LoRA adapter directory (no {CONFIG_FILE}): pass the directory "
                        f"PeftModel.save_pretrained or ktinject finetune --out wrote")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise LoraError(f"{config_path} is not valid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters can be merged")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoraError(f"{config_path}: {what} ({key}) cannot be merged by ktinject; train without {key}")
    if config.get("modules_to_save"):
        raise LoraError(f"{config_path}: modules_to_save {config['modules_to_save']} (fully trained copies of "
                        f"modules) is not supported; train with LoRA on them, or without modules_to_save")
    if config.get("target_parameters"):
        raise LoraError(f"{config_path}: target_parameters {config['target_parameters']}: LoRA on the routed "
                        f"experts' tensors is not supported yet; target the attention / dense modules")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        hint = " (adapter_model.bin: save with safe_serialization=True)" if (path / "adapter_model.bin").is_file() \
            else ""
        raise LoraError(f"{path} has no {WEIGHTS_FILE}{hint}")
    tensors = load_file(str(weights))
    pairs = _pairs(tensors, config, weights)
    base = json.loads((path / BASE_FILE).read_text()) if (path / BASE_FILE).is_file() else None
    return Adapter(path, config, pairs, base)


def _pairs(tensors: dict, config: dict, where: Path) -> dict[str, LoraPair]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None or not m.group(1).startswith(PREFIX):
            raise LoraError(f"{where}: tensor {key} is not a LoRA A / B matrix of a linear layer (embedding "
                            f"adapters and other kinds cannot be merged)")
        halves.setdefault(m.group(1)[len(PREFIX):], {})[m.group(2)] = t
    if not halves:
        raise LoraError(f"{where} holds no LoRA tensors")
    out = {}
    for name, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: {name} has lora_{''.join(ab)} but not its other half")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{where}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] "
                            f"and [out, r]")
        r = a.shape[0]
        alpha = _pattern(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", 8))
        out[name] = LoraPair(a, b, alpha / (math.sqrt(r) if config.get("use_rslora") else r))
    return out


def _pattern(patterns: dict, name: str, default):
    """PEFT's per-module pattern lookup: the first key matching the end of ``name`` (as ``(.*\\.)?KEY``)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def fingerprint(weights: dict[str, torch.Tensor]) -> dict:
    """{name: evenly spaced sampled values} of base weights (what ktinject_base.json holds)."""
    out = {}
    for name, w in sorted(weights.items()):
        flat = w.detach().reshape(-1)
        idx = torch.arange(_SAMPLES, device=flat.device) * (flat.numel() - 1) // (_SAMPLES - 1)
        out[name] = flat[idx].to("cpu", torch.float64).tolist()
    return out


def write_base_file(adapter_dir, model: nn.Module, names) -> None:
    """ktinject_base.json in ``adapter_dir``: the fingerprint of ``model``'s base weights of modules ``names``."""
    modules = dict(model.named_modules())
    data = {"config": {f: getattr(model.config, f, None) for f in _CONFIG_FIELDS},
            "weights": fingerprint({n: _base_linear(modules[n]).weight for n in names
                                    if expert_lora.split_name(n) is None})}  # (routed experts: no weight here)
    (Path(adapter_dir) / BASE_FILE).write_text(json.dumps(data, indent=1) + "\n")


def _base_linear(module: nn.Module) -> nn.Module:
    """The base layer of a PEFT-wrapped module, or the module itself."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def check_base(adapter: Adapter, config, weights: dict[str, torch.Tensor], what: str) -> None:
    """LoraError unless ``adapter`` was trained on this base: its fingerprint against ``weights`` (name -> base
    weight) where it has one, else its base_model_name_or_path's config against ``config``; ``what`` names the
    model in messages."""
    if adapter.base is not None:
        theirs = adapter.base.get("config") or {}
        diff = [f"{f} {theirs[f]} vs {getattr(config, f, None)}" for f in _CONFIG_FIELDS
                if theirs.get(f) is not None and getattr(config, f, None) is not None and theirs[f] != getattr(config, f)]
        if diff:
            raise LoraError(f"the LoRA adapter {adapter.path} was trained on another model than {what} "
                            f"({'; '.join(diff)})")
        for name, sample in adapter.base.get("weights", {}).items():
            if name not in weights:
                continue
            got = torch.tensor(fingerprint({name: weights[name]})[name], dtype=torch.float64)
            want = torch.tensor(sample, dtype=torch.float64)
            if not torch.allclose(got, want, rtol=1e-2, atol=1e-3):
                raise LoraError(f"the LoRA adapter {adapter.path} was trained on another base model: the weight of "
                                f"{name} differs from {what}'s (adapter base: "
                                f"{adapter.config.get('base_model_name_or_path')}); load it into that model")
        return
    base = adapter.config.get("base_model_name_or_path")
    base_config = Path(base).expanduser() / "config.json" if base else None
    if base_config is None or not base_config.is_file():
        return  # (a Hub name or another machine's path: the names and shapes are what can be checked)
    theirs = json.loads(base_config.read_text())
    diff = [f"{f} {theirs.get(f)} vs {getattr(config, f, None)}" for f in _CONFIG_FIELDS
            if f in theirs and getattr(config, f, None) is not None and theirs[f] != getattr(config, f)]
    if diff:
        raise LoraError(f"the LoRA adapter {adapter.path} was trained on {base}, another model than {what} "
                        f"({'; '.join(diff)})")


def merge_adapter(model: nn.Module, lora) -> list[str]:
    """Merge the adapter in directory ``lora`` (or an ``Adapter``) into ``model``'s weights in place; returns the
    merged modules' names. Everything is checked before the first weight changes."""
    adapter = lora if isinstance(lora, Adapter) else read_adapter(lora)
    modules = dict(model.named_modules())
    experts = _expert_pairs(model, modules, adapter)
    targets = {name: _target(model, modules, name, pair, adapter.path) for name, pair in adapter.pairs.items()
               if expert_lora.split_name(name) is None}
    check_base(adapter, model.config, {n: m.weight for n, m in targets.items()}, type(model).__name__)
    for block_name, pairs in experts.items():  # (checked by attach before the block changes)
        try:
            expert_lora.attach(modules[block_name], block_name, pairs)
        except ValueError as e:
            raise LoraError(f"the LoRA adapter {adapter.path}: {e}") from None
    with torch.no_grad():
        for name, module in targets.items():
            module.weight.data += adapter.pairs[name].delta(module.weight.device)  # PEFT's merge
    log.info("lora: merged %s into %d modules (%s)%s", adapter.path, len(targets), _summary(targets),
             f"; routed-expert adapters of {len(experts)} MoE blocks applied on the CPU" if experts else "")
    model.__dict__.setdefault("_ktinject_lora", []).append(str(adapter.path))
    return sorted(targets)


def _expert_pairs(model: nn.Module, modules: dict, adapter: Adapter) -> dict[str, dict]:
    """{MoE block name: {(expert, projection): (A, B, scaling)}} of the adapter's routed-expert modules."""
    out: dict[str, dict] = {}
    for name, pair in adapter.pairs.items():
        split = expert_lora.split_name(name)
        if split is None:
            continue
        block_name, e, proj = split
        block = modules.get(block_name)
        if not isinstance(modules.get(f"{block_name}.experts"), expert_lora.ExpertSlots):
            raise LoraError(f"the LoRA adapter {adapter.path} targets {name}, a routed expert, but {block_name} "
                            f"({type(block).__name__ if block is not None else 'missing'}) is not an injected MoE "
                            f"block (its experts on the CPU): inject the model with the moe operator first")
        out.setdefault(block_name, {})[(e, proj)] = (pair.a, pair.b, pair.scaling)
    return out


def _target(model: nn.Module, modules: dict, name: str, pair: LoraPair, where: Path) -> nn.Linear:
    module = modules.get(name)
    if module is None:
        near = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
        raise LoraError(f"the LoRA adapter {where} targets {name}, which {type(model).__name__} has not: the adapter "
                        f"was made for another model (this one's linear modules: {', '.join(near)})")
    if type(module) is not nn.Linear or not module.weight.is_floating_point() or module.weight.dtype.itemsize < 2:
        raise LoraError(f"the LoRA adapter {where} targets {name}, a {type(module).__name__} with a "
                        f"{module.weight.dtype} weight: only plain linear layers can take a merged adapter (an FP8 "
                        f"checkpoint: load with --dense-fp8 none)")
    r = pair.a.shape[0]
    if tuple(pair.a.shape) != (r, module.in_features) or tuple(pair.b.shape) != (module.out_features, r):
        raise LoraError(f"the LoRA adapter {where} does not fit {name}: lora_A {tuple(pair.a.shape)} and lora_B "
                        f"{tuple(pair.b.shape)} against a weight of [{module.out_features}, {module.in_features}] "
                        f"(an adapter for another model)")
    return module


def _summary(targets: dict) -> str:
    kinds = sorted({n.rsplit(".", 1)[-1] for n in targets})
    return ", ".join(kinds)


def save_merged(base_dir, lora, out_dir) -> Path:
    """Write ``base_dir``'s checkpoint with the adapter ``lora`` merged into ``out_dir`` (a new or empty directory):
    shards without adapted tensors copied as they are, the others rewritten with ``W + scaling * B @ A`` in the
    tensor's dtype; config, tokenizer and the other files copied. Returns ``out_dir``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    base_dir, out_dir = Path(base_dir).expanduser(), Path(out_dir).expanduser()
    shards = sorted(base_dir.glob("*.safetensors")) if base_dir.is_dir() else []
    if not shards:
        raise LoraError(f"save_merged: {base_dir} is not a safetensors checkpoint directory (a GGUF model cannot "
                        f"be merged into)")
    if out_dir.exists() and (out_dir.resolve() == base_dir.resolve() or any(out_dir.iterdir())):
        raise LoraError(f"save_merged: {out_dir} exists and is not empty: give a new directory")
    adapter = lora if isinstance(lora, Adapter) else read_adapter(lora)
    routed = sorted(n for n in adapter.pairs if expert_lora.split_name(n) is not None)
    if routed:
        raise LoraError(f"save_merged: the adapter {adapter.path} adapts the routed experts ({routed[0]} and "
                        f"{len(routed) - 1} more): merging them would rewrite the fused (and, where quantized, "
                        f"requantized) expert tensors; load the base model with lora={adapter.path} instead")
    keys = {f"{name}.weight": name for name in adapter.pairs}
    where: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            names = set(f.keys())
        where.update({k: shard for k in keys if k in names})
        scaled = sorted(k for k in keys if f"{k}_scale_inv" in names or f"{k}_scale" in names)
        if scaled:
            raise LoraError(f"save_merged: {scaled[0]} in {shard.name} is quantized (scales beside it): merge into a "
                            f"dequantized checkpoint")
    missing = sorted(set(keys) - set(where))
    if missing:
        raise LoraError(f"save_merged: {base_dir} has no tensor {missing[0]} (the adapter's module {keys[missing[0]]})"
                        f"{f' nor {len(missing) - 1} more' if len(missing) > 1 else ''}: the adapter was made for "
                        f"another model, or the checkpoint names its tensors unlike the model's modules")
    base_weights = {}
    for key, shard in where.items():
        with safe_open(str(shard), "pt") as f:
            base_weights[keys[key]] = f.get_tensor(key)
    check_base(adapter, AutoConfig.from_pretrained(base_dir), base_weights, str(base_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in sorted(base_dir.iterdir()):
        if item.is_file() and item.suffix != ".safetensors" and not item.name.startswith(".") and \
                item.name != "SHA256SUMS.json":  # (the demo model's checksums: of the base weights)
            shutil.copy2(item, out_dir / item.name)
    for shard in shards:  # one shard in memory at a time
        if shard not in where.values():
            shutil.copy2(shard, out_dir / shard.name)
            continue
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(shard))
        for key in [k for k, s in where.items() if s == shard]:
            w = tensors[key]
            tensors[key] = (w.float() + adapter.pairs[keys[key]].delta()).to(w.dtype)  # as merge_adapter rounds
        save_file(tensors, str(out_dir / shard.name), metadata=metadata)
        del tensors
    log.info("lora: %s + %s merged into %s", base_dir, adapter.path, out_dir)
    return out_dir

