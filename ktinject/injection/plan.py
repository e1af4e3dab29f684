"""Model + rules -> Plan: which module becomes which operator, which tensor goes to which device, how many bytes.

Pure: reads module names, classes and tensor shapes; moves nothing; works on meta-device models.

The walk starts at the root and visits parents before children (``named_modules`` order; a module reachable
under two names is visited once, under the first). For each module the first matching rule wins:
  - ``replace: OP``: an operator entry; the operator owns the module's whole subtree (nothing below is walked);
  - ``device: D``: a device entry; tensors in the subtree go to D unless a deeper entry says otherwise;
    ``recursive: false`` stops matching below it (the whole subtree follows D).
Tensors (parameters and buffers, persistent or not: rotary ``inv_freq`` must move too) outside operator subtrees
go to the device of their deepest matched ancestor, else to the ``gpu`` device. A tensor shared by several modules
(tied embeddings) appears once, under the first name the walk meets, and its bytes count once.

Device variables: ``gpu`` (default: the current CUDA device, or "cpu" with a warning when there is no CUDA) and
``cpu``; ``plan(model, gpu="cpu")`` overrides them and ``plan(model, fast="cuda:1")`` defines new ones for rules
that say ``device: fast``. A rule device that is not a variable is read as a torch device string.
"""
from __future__ import annotations

import difflib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import nn

from ktinject import operators
from ktinject.decode.stateful_layers import eager_decode_reason
from ktinject.gpu_experts.hot.settings import human_bytes
from ktinject.operators.base import OperatorError
from ktinject.injection.rules import FAMILIES, Rule, RuleError, RuleSet, class_path, load_rules, rules_for_model

log = logging.getLogger(__name__)

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class PlanEntry:
    """A module a rule matched. ``operator`` is None for device-only entries; ``nbytes`` is {str(device): bytes}:
    the operator's own placement for operator entries, the bytes of the tensors the entry places otherwise."""

    name: str
    class_name: str
    rule: Rule
    operator: str | None
    device: torch.device
    kwargs: Mapping[str, Any]
    nbytes: dict[str, int]


@dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`. ``tensor_devices`` maps every parameter and buffer outside operator subtrees to
    its device; ``unclaimed_nbytes`` counts tensors no entry placed (they go to the gpu device)."""

    entries: tuple[PlanEntry, ...]
    tensor_devices: Mapping[str, torch.device] = field(repr=False)
    devices: Mapping[str, torch.device]
    unmatched_rules: tuple[Rule, ...]
    unclaimed_nbytes: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    #: why the model's decode steps will run eagerly in HF's cache (``decode.stateful_layers``), or None
    eager_decode: str | None = None
    #: how an ``auto`` (or share) hot-expert budget was found once the model was injected
    #: (``gpu_experts.hot.budget.Budget``), or None: a budget in bytes, or not injected yet
    gpu_budget: Any = None

    def bytes_per_device(self) -> dict[str, int]:
        """Total bytes each device will hold: {str(device): bytes}."""
        total: Counter[str] = Counter(self.unclaimed_nbytes)
        for entry in self.entries:
            total.update(entry.nbytes)
        return dict(total)

    def record_budget(self, budget: Any) -> None:
        """Set ``gpu_budget``: the one field filled after planning, by the injection that measured the GPU (the
        plan stays the object the caller holds, so printing it shows the budget)."""
        object.__setattr__(self, "gpu_budget", budget)

    def operator_entries(self) -> tuple[PlanEntry, ...]:
        """The entries an operator will replace, in walk order."""
        return tuple(e for e in self.entries if e.operator is not None)

    def __str__(self) -> str:
        return format_plan(self)


def plan(model: nn.Module, rules: Any = None, *, quant: str | None = None, defer: int | float | None = None,
         group_size: int | None = None, **devices: Any) -> Plan:
    """Match ``rules`` (a path, packaged name, list, RuleSet; None: chosen by ``config.model_type``) against
    ``model``. ``quant``, ``group_size`` (int4) and ``defer`` override the kwarg of that name of every operator that
    accepts one.
    ``devices`` sets device variables (``gpu="cpu"``)."""
    ruleset = rules_for_model(model) if rules is None else load_rules(rules)
    _check_device_names(devices, ruleset)
    devs = resolve_devices(devices)
    overrides = {key: v for key, v in (("quant", quant), ("group_size", group_size), ("defer", defer))
                 if v is not None}
    ops = _operators(ruleset, overrides)
    rule_devices = [_rule_device(rule, devs) for rule in ruleset.rules]
    walk = _Walk(ruleset, ops, rule_devices, devs["gpu"], overrides)
    try:
        walk.run(model)
    except OperatorError as e:
        note = _family_note(rules, model)
        if note is None:
            raise
        raise OperatorError(f"{e}\n{note}") from e
    unmatched = tuple(r for i, r in enumerate(ruleset.rules) if i not in walk.matched)
    moe_rules = [r for r in ruleset.rules if r.replace == "moe"]
    if moe_rules and all(r in unmatched for r in moe_rules) and _has_moe_block(model, ops.get("moe")):
        # every routed expert would stay where the model is (on a real model and a GPU: all of them on the GPU)
        notes = "; ".join(unmatched_note(r, model) for r in moe_rules)
        family = _family_note(rules, model)
        raise RuleError(f"no module of {type(model).__name__} matched a moe rule, so no experts would move to the "
                        f"CPU: {notes}" + (f"\n{family}" if family else ""))
    for rule in unmatched:
        log.warning("%s", unmatched_note(rule, model))
    return Plan(
        entries=tuple(walk.entries()),
        tensor_devices=MappingProxyType(walk.tensor_devices),
        devices=MappingProxyType(devs),
        unmatched_rules=unmatched,
        unclaimed_nbytes=MappingProxyType(dict(walk.unclaimed)),
        eager_decode=eager_decode_reason(model),
    )


def _has_moe_block(model: nn.Module, op) -> bool:
    """Whether some module of ``model`` (one with an ``experts`` child, as every family's sparse block has) is one
    the moe operator could take: a model whose layers are all dense (first_k_dense_replace, mlp_only_layers) has
    none, and moe rules that match nothing are then no mistake."""
    return op is not None and any(_takes(op, module, name, {}) for name, module in model.named_modules()
                                  if "experts" in module._modules)


def _takes(op, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether operator ``op`` can take ``module`` with ``kwargs`` (its check passes)."""
    try:
        op.check(module, name, MappingProxyType(dict(kwargs)))
    except OperatorError:
        return False
    return True


def _family_note(rules: Any, model: nn.Module) -> str | None:
    """A line for rules given as a packaged family's name or file that is not the model's family (a common way to
    reach a module the rules cannot take)."""
    name = Path(str(rules)).name.removesuffix(".yaml") if isinstance(rules, (str, Path)) else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if name not in FAMILIES or name == model_type:
        return None
    mine = "its packaged rules: rules=None" if model_type in FAMILIES else \
        "ktinject runs Mixture-of-Experts families only" if model_type is not None else ""
    return f"(these are the {name} rules, and the model's config.model_type is {model_type!r}; {mine})"


def unmatched_note(rule: Rule, model: nn.Module) -> str:
    """One line on a rule that matched no module of ``model``: where it is written, what it matches, and for a
    ``match.class`` that no module has, the model's closest class name (a misspelled class is the usual cause)."""
    asked = ", ".join(f"{k}={v!r}" for k, v in (("name", rule.match_name), ("class", rule.match_class))
                     if v is not None)
    hint = ""
    if rule.match_class is not None:
        dotted = "." in rule.match_class
        classes = {class_path(type(m)) if dotted else type(m).__name__ for m in model.modules()}
        lower = {c.lower(): c for c in sorted(classes)}  # MoE vs Moe: case first, then spelling
        close = difflib.get_close_matches(rule.match_class.lower(), list(lower), n=1, cutoff=0.6)
        if rule.match_class in classes:
            hint = "; modules of that class exist, but none has a matching name"
        elif close:
            hint = f"; did you mean {lower[close[0]]!r}?"
        else:
            hint = "; no module has that class"
    return f"{rule.where} matched no module of {type(model).__name__} (match: {asked}{hint})"


# ---------------------------------------------------------------------------------------------- devices


def _as_device(value: Any, what: str) -> torch.device:
    try:
        device = value if isinstance(value, torch.device) else torch.device(value)
    except (RuntimeError, TypeError, ValueError) as e:
        raise RuleError(f"{what}: {value!r} is not a torch device (write e.g. 'cpu', 'cuda', 'cuda:1'): {e}") from e
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


#: the keyword options of inject / from_pretrained / load_into: every other keyword is a device variable, so a
#: misspelled option arrives here as one (suggestions are drawn from these)
OPTIONS = ("quant", "defer", "prefill", "gpu_experts_budget", "placement", "stats", "rebalance_every", "checkpoint",
           "cache_dir", "progress", "dtype", "prefix_cache", "gpu_memory", "max_batch", "max_context",
           "gpu_reserve")


def _check_device_names(devices: Mapping[str, Any], ruleset: RuleSet) -> None:
    """TypeError for a device variable no rule uses (``gpu`` and ``cpu`` always count): a misspelled option
    (``prefil="cpu"``) would otherwise be taken silently, or fail as 'not a torch device'."""
    used = {"gpu", "cpu"} | {r.device for r in ruleset.rules if r.device is not None}
    for name, value in devices.items():
        if name in used:
            continue
        if name in OPTIONS:  # an option of another entry point (cache_dir, progress, dtype: from_pretrained)
            raise TypeError(f"unexpected keyword argument {name}={value!r}: this call does not take {name} (of "
                            f"inject, from_pretrained and load_into, see which one names it in its docstring)")
        close = difflib.get_close_matches(name, [*OPTIONS, *sorted(used)], n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}=...? " if close else ""
        raise TypeError(f"unexpected keyword argument {name}={value!r}: {hint}Keywords other than the options "
                        f"({', '.join(OPTIONS)}) name device variables, and no rule uses a device {name!r} (the "
                        f"rules use {', '.join(sorted(used))})")


def resolve_devices(overrides: Mapping[str, Any]) -> dict[str, torch.device]:
    """Device variables: defaults for ``gpu`` and ``cpu`` plus ``overrides`` (name -> device or device string)."""
    devs: dict[str, torch.device] = {"cpu": torch.device("cpu")}
    for name, value in overrides.items():
        devs[name] = _as_device(value, f"plan({name}=...)")
    if "gpu" not in devs:
        if torch.cuda.is_available():
            devs["gpu"] = _as_device("cuda", "gpu")
        else:
            log.warning("no CUDA device: the 'gpu' device variable is 'cpu' (pass gpu=... to choose one)")
            devs["gpu"] = torch.device("cpu")
    return devs


def _rule_device(rule: Rule, devs: Mapping[str, torch.device]) -> torch.device:
    name = rule.device if rule.device is not None else "gpu"
    if name in devs:
        return devs[name]
    try:
        return _as_device(name, rule.where)
    except RuleError:
        raise RuleError(
            f"{rule.where}: key 'device': {name!r} is neither a device variable ({', '.join(sorted(devs))}) nor "
            f"a torch device string; define it with plan(..., {name}='cuda:1') or write e.g. 'cuda:0'"
        ) from None


# ---------------------------------------------------------------------------------------------- operators


def _operators(ruleset: RuleSet, overrides: Mapping[str, Any]) -> dict[str, type]:
    """Look up every operator the rules name (matched or not) and check each rule's kwargs against it."""
    ops: dict[str, type] = {}
    for rule in ruleset.rules:
        if rule.replace is None:
            continue
        try:
            op = ops[rule.replace] = operators.get(rule.replace)
        except KeyError:
            raise RuleError(
                f"{rule.where}: key 'replace': unknown operator {rule.replace!r}; known operators: "
                f"{', '.join(operators.known()) or '(none)'}"
            ) from None
        bad = sorted(set(rule.kwargs) - set(op.kwargs_allowed))
        if bad:
            allowed = ", ".join(sorted(op.kwargs_allowed)) or "none"
            raise RuleError(f"{rule.where}: key 'kwargs': operator {rule.replace!r} does not take {', '.join(bad)}; "
                            f"it takes: {allowed}")
    for key, value in overrides.items():
        if not any(key in op.kwargs_allowed for op in ops.values()):
            log.warning("%s=%r ignored: no operator in the rules (%s) takes a %r argument", key, value,
                        ", ".join(sorted(ops)) or "none", key)
    return ops


class _Walk:
    """Mutable state of one walk over a model (see the module docstring for the semantics)."""

    def __init__(self, ruleset: RuleSet, ops: Mapping[str, type], rule_devices: list[torch.device],
                 gpu: torch.device, overrides: Mapping[str, Any]):
        self.ruleset, self.ops, self.rule_devices, self.gpu = ruleset, ops, rule_devices, gpu
        self.overrides = overrides  # kwargs set for every operator that takes them (plan's quant, defer)
        self.matched: set[int] = set()
        self.tensor_devices: dict[str, torch.device] = {}
        self.unclaimed: Counter[str] = Counter()
        self._pending: list[tuple[PlanEntry, Counter[str] | None]] = []
        self._seen_modules: set[int] = set()
        self._seen_tensors: set[int] = set()

    def entries(self) -> list[PlanEntry]:
        out = []
        for entry, placed in self._pending:
            if placed is not None:  # device entry: the bytes it placed
                entry = PlanEntry(entry.name, entry.class_name, entry.rule, None, entry.device, entry.kwargs,
                                  dict(placed) or {str(entry.device): 0})
            out.append(entry)
        return out

    def run(self, model: nn.Module) -> None:
        # stack items: (name, module, index of the placing entry or None, still matching rules?)
        stack: list[tuple[str, nn.Module, int | None, bool]] = [("", model, None, True)]
        while stack:
            name, module, owner, matching = stack.pop()
            if id(module) in self._seen_modules:
                continue
            self._seen_modules.add(id(module))
            if matching:
                idx = self.ruleset.first_match(name, class_path(type(module)))
                if idx is not None:
                    self.matched.add(idx)
                    rule = self.ruleset.rules[idx]
                    if rule.replace is not None:
                        self._operator_entry(name, module, rule, self.rule_devices[idx])
                        continue
                    owner = len(self._pending)
                    self._pending.append((PlanEntry(name, type(module).__name__, rule, None,
                                                    self.rule_devices[idx], _EMPTY, {}), Counter()))
                    matching = rule.recursive
            self._place_tensors(name, module, owner)
            children = [(f"{name}.{n}" if name else n, child) for n, child in module.named_children()]
            for child_name, child in reversed(children):
                stack.append((child_name, child, owner, matching))

    def _place_tensors(self, name: str, module: nn.Module, owner: int | None) -> None:
        device = self.gpu if owner is None else self._pending[owner][0].device
        placed = self.unclaimed if owner is None else self._pending[owner][1]
        tensors = list(module.named_parameters(prefix=name, recurse=False))
        tensors += list(module.named_buffers(prefix=name, recurse=False))
        for tensor_name, tensor in tensors:
            if id(tensor) in self._seen_tensors:
                continue  # tied: already placed under its first name
            self._seen_tensors.add(id(tensor))
            self.tensor_devices[tensor_name] = device
            placed[str(device)] += tensor.numel() * tensor.element_size()

    def _operator_entry(self, name: str, module: nn.Module, rule: Rule, device: torch.device) -> None:
        op = self.ops[rule.replace]
        kwargs = dict(rule.kwargs)
        kwargs.update((key, v) for key, v in self.overrides.items() if key in op.kwargs_allowed)
        kwargs = MappingProxyType(kwargs)
        cls_name = type(module).__name__
        try:
            op.check(module, name, kwargs)
        except OperatorError as e:
            given = {k: v for k, v in self.overrides.items() if k in op.kwargs_allowed}
            if given and _takes(op, module, name, rule.kwargs):  # the rule alone is fine: the argument is at fault
                args = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise OperatorError(f"{args} (an argument of inject / from_pretrained, or the chat's and the "
                                    f"server's --{next(iter(given))}) does not fit module {name!r} ({cls_name}): "
                                    f"{e}") from e
            why = str(e)
            same = f"{rule.replace}: cannot take module {name!r} ({cls_name}): "
            why = f"{rule.replace}: {why[len(same):]}" if why.startswith(same) else why  # (said once is enough)
            raise OperatorError(f"{rule.where}: operator {rule.replace!r} cannot take module {name!r} "
                                f"({cls_name}): {why}") from e
        nbytes = {str(k): int(v) for k, v in op.placement(module, kwargs, device).items()}
        self._pending.append((PlanEntry(name, cls_name, rule, rule.replace, device, kwargs, nbytes), None))
        for sub in module.modules():  # the operator owns the subtree: never walk it again under another name
            self._seen_modules.add(id(sub))


# ---------------------------------------------------------------------------------------------- printing


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0..2,5,7..8'."""
    parts, start = [], None
    nums = sorted(set(numbers))
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}..{n}")
            start = None
    return ",".join(parts)


def _device_bytes(nbytes: Mapping[str, int]) -> str:
    if len(nbytes) == 1:
        return human_bytes(next(iter(nbytes.values())))
    return " + ".join(f"{d} {human_bytes(b)}" for d, b in sorted(nbytes.items()))


_LAYER = re.compile(r"(?<![^.])\d+(?![^.])")  # the first all-digit path component


def _collapse(entries: tuple[PlanEntry, ...]) -> list[tuple[str, PlanEntry, int]]:
    """Group entries identical apart from their first numeric path component: (display name, first entry, count)."""
    groups: dict[tuple, tuple[PlanEntry, list[int], list[str]]] = {}
    for entry in entries:
        m = _LAYER.search(entry.name)
        pattern = entry.name if m is None else entry.name[:m.start()] + "{}" + entry.name[m.end():]
        key = (pattern, entry.class_name, entry.rule.source, entry.rule.index, entry.operator, str(entry.device),
               tuple(sorted((k, repr(v)) for k, v in entry.kwargs.items())), tuple(sorted(entry.nbytes.items())))
        group = groups.setdefault(key, (entry, [], []))
        group[2].append(entry.name)
        if m is not None:
            group[1].append(int(m.group()))
    rows = []
    for (pattern, *_), (first, numbers, names) in groups.items():
        shown = names[0] if len(names) == 1 else pattern.replace("{}", "{" + _ranges(numbers) + "}")
        rows.append((shown or "(root)", first, len(names)))
    return rows


def format_plan(p: Plan) -> str:
    """A table of the plan's entries (repeated layers collapsed) and the bytes per device."""
    header = ("module", "class", "rule", "operator", "device", "bytes")
    rows = [header]
    for shown, entry, count in _collapse(p.entries):
        size = _device_bytes(entry.nbytes)
        if count > 1:
            size = f"{_device_bytes({d: b * count for d, b in entry.nbytes.items()})} ({count} x {size})"
        rows.append((shown, entry.class_name, entry.rule.label, entry.operator or "-", str(entry.device), size))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    per_device = p.bytes_per_device()
    total = sum(per_device.values())
    summary = ", ".join(f"{d} {human_bytes(b)}" for d, b in sorted(per_device.items()))
    lines.append(f"bytes per device: {summary or 'none'} (total {human_bytes(total)})")
    if p.unclaimed_nbytes:
        lines.append(f"  of which placed by no rule (default gpu device): {_device_bytes(p.unclaimed_nbytes)}")
    lines.append("devices: " + ", ".join(f"{k}={v}" for k, v in sorted(p.devices.items())))
    for rule in p.unmatched_rules:
        lines.append(f"unmatched rule: {rule.where}")
    if p.eager_decode:
        lines.append(f"decode: eager, {p.eager_decode}")
    if p.gpu_budget is not None:
        lines.extend(p.gpu_budget.lines())
    return "\n".join(lines)


