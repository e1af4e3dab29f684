"""The hot-expert options, validated once: every entry point (``inject``, ``from_pretrained``, the chat's flags,
moe rule kwargs) turns its options into a ``HotExpertSettings`` here, so they share names, defaults and errors.

    option (keyword / rule kwarg)   chat flag               meaning
    gpu_experts_budget              --gpu-experts-budget    GPU bytes for resident experts: 'auto' (the default),
                                                            0 (none), a size (an int or '12GiB') or a share of
                                                            what the run leaves free (a float, 0 < f <= 1: '0.5')
    placement                       --placement             frequency | uniform | dynamic | none
    stats                           --expert-stats          statistics file (python -m ktinject.calibrate) or
                                                            an ExpertStats
    rebalance_every                 --rebalance-every       dynamic: tokens between re-rankings

Defaults: ``placement`` is ``frequency`` when ``stats`` are given, else ``dynamic`` (without statistics there is
nothing to rank by before decoding; ``dynamic`` learns the ranking from the routing while it decodes);
``rebalance_every`` is 64 tokens. The budget is ``auto`` unless one is given (here or in the moe rules): the free
GPU memory less what the run needs (``budget.fit``), measured where the model is injected
(``ktinject.injection.gpu_budget``); ``auto`` and a share are held as ``fraction`` until then (``budget`` 0). A
budget of 0 or placement ``none`` places nothing.

Pure: no torch, no model; the module a CLI may import before anything heavy loads.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

STRATEGIES = ("frequency", "uniform", "dynamic", "none")
DEFAULT_REBALANCE_EVERY = 64
#: option names as the keywords of inject / from_pretrained and the moe rules' kwargs (HotExpertSettings fields in
#: the same order: budget, strategy, stats, rebalance_every)
OPTIONS = ("gpu_experts_budget", "placement", "stats", "rebalance_every")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(value: Any) -> int:
    """Bytes from an int/float or a string like '12GiB', '512 MiB', '1.5GB', '0' (GiB/MiB binary, GB/MB decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"byte size {value!r}: expected a number or a string like '12GiB'")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"byte size {value!r}: expected a number with an optional unit (B, KiB, MiB, GiB, TiB, "
                             f"KB, MB, GB, TB), e.g. '12GiB'")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"byte size {value!r}: must be a non-negative number of bytes")
    return int(n)


def parse_budget(value: Any) -> tuple[int, float | None]:
    """(bytes, fraction) of a ``gpu_experts_budget``: 'auto' -> (0, 1.0); a float (or a unitless decimal string)
    0 < f <= 1 -> (0, f), a share of what the run leaves free; anything else a byte size -> (bytes, None)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0, 1.0
    share = value if isinstance(value, float) else None
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", value):
        share = float(value)
    if share is not None and 0 < share <= 1:
        return 0, share
    return parse_bytes(value), None


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    return strategy


def default_strategy(stats: Any) -> str:
    """The placement used when none is named: ``frequency`` with statistics, else ``dynamic``."""
    return "frequency" if stats is not None else "dynamic"


@dataclass(frozen=True)
class HotExpertSettings:
    """Validated hot-expert options. ``budget`` bytes; ``strategy`` one of STRATEGIES; ``stats`` None, a file path
    or an ExpertStats (``ktinject.gpu_experts.hot.stats``); ``rebalance_every`` tokens (used by ``dynamic``);
    ``fraction``: None for a budget in bytes, else the share of what the run leaves free on the GPU (1.0: ``auto``)
    that ``budget`` becomes once measured (``resolved``)."""

    budget: int
    strategy: str
    stats: Any = None
    rebalance_every: int = DEFAULT_REBALANCE_EVERY
    fraction: float | None = None

    @property
    def request(self) -> str:
        """The budget as asked for, for reports: 'auto', '0.5 of what is left', '12.0 GiB'."""
        if self.fraction is None:
            return human_bytes(self.budget)
        return "auto" if self.fraction == 1 else f"{self.fraction:g} of what is left"

    def resolved(self, budget: int) -> HotExpertSettings:
        """These settings with a measured budget of ``budget`` bytes."""
        return dataclasses.replace(self, budget=int(budget), fraction=None)

    @classmethod
    def make(cls, gpu_experts_budget: Any = None, placement: str | None = None, stats: Any = None,
             rebalance_every: Any = None, *, where: str = "") -> HotExpertSettings:
        """Settings from the options as the entry points take them (None: the default); ValueError naming the
        option (and ``where`` it was written, e.g. a rule) and what to write instead."""
        at = f"{where}: " if where else ""
        try:
            budget, fraction = (0, None) if gpu_experts_budget is None else parse_budget(gpu_experts_budget)
        except ValueError as e:
            raise ValueError(f"{at}gpu_experts_budget: expected 'auto', bytes or a size like '12GiB', or a share "
                             f"like 0.5, got {gpu_experts_budget!r} ({e})") from None
        if stats is not None and not isinstance(stats, (str, Path)) and not hasattr(stats, "counts"):
            raise ValueError(f"{at}stats: expected a statistics file (python -m ktinject.calibrate) or an "
                             f"ExpertStats, got {type(stats).__name__}")
        if isinstance(stats, (str, Path)) and not Path(stats).is_file():
            raise ValueError(f"{at}stats: expert statistics file not found: {stats} (write one with python -m "
                             f"ktinject.calibrate)")
        strategy = default_strategy(stats) if placement is None else placement
        if strategy not in STRATEGIES:
            raise ValueError(f"{at}placement: expected one of {', '.join(STRATEGIES)}, got {placement!r}")
        every = DEFAULT_REBALANCE_EVERY if rebalance_every is None else rebalance_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{at}rebalance_every: expected a positive number of tokens, got {rebalance_every!r}")
        return cls(budget, strategy, stats, every, fraction)

    @classmethod
    def from_plan(cls, plan: Any, **given: Any) -> HotExpertSettings | None:
        """Settings from the moe rules' kwargs in ``plan`` (the rules must agree: the options are model-wide),
        overridden by the ones ``given`` as keywords (None: not given); a budget set nowhere is ``auto``. None when
        nothing is to be placed (a budget of 0 with no placement, or placement ``none``). A bad value raises
        ValueError naming the rule or the keyword."""
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown hot-expert option(s) {', '.join(unknown)}; expected {', '.join(OPTIONS)}")
        found: dict[str, tuple[Any, str]] = {}
        for entry in plan.operator_entries():
            for name in OPTIONS:
                value = entry.kwargs.get(name)
                if value is None:
                    continue
                where = entry.rule.where
                if name in found and found[name][0] != value:
                    raise ValueError(f"moe rules disagree on {name}: {found[name][0]!r} ({found[name][1]}) vs "
                                     f"{value!r} ({where}); hot experts are placed model-wide: give one value")
                if name not in found:
                    cls.make(**{name: value}, where=where)  # checked where it is written
                    found[name] = (value, where)
        merged = {name: value for name, (value, _) in found.items()}
        merged.update({k: v for k, v in given.items() if v is not None})
        if merged.get("placement") == "none":
            return None
        merged.setdefault("gpu_experts_budget", "auto")
        settings = cls.make(**merged)
        if settings.fraction is None and settings.budget == 0 and merged.get("placement") is None:
            return None
        return settings
