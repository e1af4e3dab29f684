"""Rule files: which module of a model becomes which operator, or goes to which device.

A rule file is a YAML list, read top to bottom. Each item is a rule or an include::

    # rules/qwen3_moe.yaml
    - match: {class: Qwen3MoeSparseMoeBlock}   # the MoE block of every sparse layer (dense layers are Qwen3MoeMLP)
      replace: moe                             # a registered operator id (ktinject.operators.known())
      kwargs: {quant: int8}                    # optional, passed to the operator
      device: gpu                              # where the operator's GPU side lives (default: gpu)
    - match: {name: 'model\\.layers\\.\\d+\\.self_attn'}
      replace: attention
    - match: {name: 'lm_head'}
      device: cpu                              # device only: the module and its subtree go there
      recursive: false                         # do not look at the modules below this one
    - include: common.yaml                     # spliced in place

Rule keys (anything else is an error):
  match      required; at least one of
               name:  a Python regular expression matched against the WHOLE dotted module name (``re.fullmatch``:
                      ``mlp`` matches only a top-level module called mlp; write ``.*\\.mlp`` for any of them).
                      The root module's name is the empty string.
               class: the module's class name (``Qwen3MoeSparseMoeBlock``) or its full dotted path
                      (``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock``). Exact match:
                      subclasses do not match, so a rule never claims a module nobody wrote it for.
             with both, both must match.
  replace    an operator id: the module and its whole subtree are handed to that operator.
  kwargs     a mapping of keyword arguments for the operator (only with replace).
  device     a device variable (``gpu``, ``cpu``, or any name passed as ``plan(..., name="cuda:1")``) or a
             literal torch device string (``cuda:0``). Variables are resolved by ktinject.plan.
  recursive  true (default) or false: false stops the walk below the matched module (its subtree follows it).
A rule needs ``replace`` or ``device`` (or both).

Order matters: for each module (walking from the root, parents first) the FIRST rule that matches wins. An item
``- include: FILE`` splices FILE's rules in at that position; FILE is looked up relative to the including file,
then among the packaged rule files (``rules/`` in the source tree, installed as ``ktinject.rulefiles``). Include
cycles are an error. Operator ids are checked when a plan is made (operators register themselves on first use).

Errors are RuleError (a ValueError) and name the file, the rule index (0-based position in its file's list), the
line and the key.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence, Union

import yaml

log = logging.getLogger(__name__)

RULE_KEYS = ("match", "replace", "kwargs", "device", "recursive")
MATCH_KEYS = ("name", "class")

#: config.model_type -> packaged rule file
FAMILIES: Mapping[str, str] = MappingProxyType({
    "qwen3_moe": "qwen3_moe.yaml",
    "qwen2_moe": "qwen2_moe.yaml",
    "mixtral": "mixtral.yaml",
    "olmoe": "olmoe.yaml",
    "deepseek_v2": "deepseek_v2.yaml",
    "deepseek_v3": "deepseek_v3.yaml",
    "kimi_k2": "deepseek_v3.yaml",  # Kimi-K2 checkpoints are DeepSeek-V3 architecture under their own model_type
    "kimi_k25": "deepseek_v3.yaml",  # Kimi-K2.5: that text model under model.language_model of an image-text model
    "glm4_moe": "glm4_moe.yaml",
    "gpt_oss": "gpt_oss.yaml",
    "minimax_m2": "minimax_m2.yaml",
    "glm4_moe_lite": "glm4_moe_lite.yaml",
    "ernie4_5_moe": "ernie4_5_moe.yaml",
    "hunyuan_v1_moe": "hunyuan_v1_moe.yaml",
    "dots1": "dots1.yaml",
    "qwen3_next": "qwen3_next.yaml",
    "qwen3_5_moe": "qwen3_5_moe.yaml",  # the image-text model: its language model under model.language_model
    "qwen3_5_moe_text": "qwen3_5_moe.yaml",  # the text model alone (Qwen3_5MoeForCausalLM)
    "deepseek_v32": "deepseek_v32.yaml",
    "glm_moe_dsa": "glm_moe_dsa.yaml",
    "llama4_text": "llama4.yaml",  # the text model (Llama4ForCausalLM)
    "deepseek_v4": "deepseek_v4.yaml",
})

_CLASS_RE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
_DEVICE_RE = re.compile(r"[A-Za-z_][\w]*(:\d+)?")


class RuleError(ValueError):
    """A rule file (or a rule's use in a plan) is wrong; the message names the file, rule index, line and key."""


@dataclass(frozen=True)
class Rule:
    """One validated rule. ``source``/``index``/``line`` say where it was written (for messages)."""

    match_name: str | None = None
    match_class: str | None = None
    replace: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    device: str | None = None
    recursive: bool = True
    source: str = "<code>"
    index: int = 0
    line: int | None = None
    _regex: re.Pattern | None = field(init=False, repr=False, compare=False, hash=False, default=None)

    def __post_init__(self) -> None:
        if self.match_name is None and self.match_class is None:
            raise RuleError(f"{self.where}: a rule needs match.name and/or match.class")
        object.__setattr__(self, "kwargs", MappingProxyType(dict(self.kwargs)))
        if self.match_name is not None:
            object.__setattr__(self, "_regex", re.compile(self.match_name))

    @property
    def file(self) -> str:
        """Base name of the file the rule is written in."""
        return self.source.replace("\\", "/").rsplit("/", 1)[-1]

    @property
    def label(self) -> str:
        """Short reference ``file:index`` (for tables)."""
        return f"{self.file}:{self.index}"

    @property
    def where(self) -> str:
        """Full reference ``source: rule[index] (line N)`` (for messages)."""
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{self.source}: rule[{self.index}]{line}"

    def matches(self, name: str, class_path: str) -> bool:
        """Does the rule match a module called ``name`` whose class is ``class_path`` (``module.QualName``, or a
        bare class name)?  Pure; see the module docstring for the semantics."""
        if self._regex is not None and self._regex.fullmatch(name) is None:
            return False
        if self.match_class is not None:
            return self.match_class == class_path or self.match_class == class_path.rpartition(".")[2]
        return True


@dataclass(frozen=True)
class RuleSet:
    """An ordered, include-expanded list of rules; ``sources`` are the files read, in order."""

    rules: tuple[Rule, ...]
    sources: tuple[str, ...] = ()

    def first_match(self, name: str, class_path: str) -> int | None:
        """Position (in ``rules``) of the first rule matching the module, or None."""
        for i, rule in enumerate(self.rules):
            if rule.matches(name, class_path):
                return i
        return None

    def match(self, name: str, class_path: str) -> Rule | None:
        """The first rule matching the module, or None."""
        i = self.first_match(name, class_path)
        return None if i is None else self.rules[i]

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)


def class_path(cls: type) -> str:
    """``module.QualName`` of a class: what ``match.class`` is compared with."""
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------- file lookup


@dataclass(frozen=True)
class _Source:
    key: str  # identity, for include cycles
    display: str  # shown in messages and Rule.source
    path: Any  # pathlib.Path or an importlib.resources Traversable
    packaged: bool


def _packaged_dir():
    try:
        return resources.files("ktinject.rulefiles")
    except ModuleNotFoundError:  # a source checkout that is not installed: rules/ beside the package
        return Path(__file__).resolve().parents[2] / "rules"


def packaged_files() -> list[str]:
    """Names of the packaged rule files (``qwen3_moe.yaml``, ...)."""
    return sorted(p.name for p in _packaged_dir().iterdir() if p.name.endswith(".yaml"))


def supported_families() -> list[str]:
    """The ``config.model_type`` values that have a packaged rule file."""
    return sorted(FAMILIES)


def _packaged(name: str) -> _Source | None:
    if not name.endswith((".yaml", ".yml")):
        name += ".yaml"
    path = _packaged_dir() / name
    if not path.is_file():
        return None
    return _Source(f"packaged:{name}", f"ktinject.rulefiles/{name}", path, True)


def _resolve(spec: Any, including: _Source | None, where: str) -> _Source:
    """Find a rule file: a path (relative to the including file, if any), else a packaged file name."""
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise RuleError(f"{where}: a rule file must be given as a path or a packaged name, got {spec!r}")
    spec = os.fspath(spec)
    looked = []
    if including is None:
        path = Path(spec)
        looked.append(str(path))
        if path.is_file():
            return _Source(f"file:{path.resolve()}", str(path), path, False)
    elif not including.packaged:
        path = Path(including.path).parent / spec
        looked.append(str(path))
        if path.is_file():
            return _Source(f"file:{path.resolve()}", str(path), path, False)
    parent = os.path.dirname(spec)
    if parent in ("", "rules") or (including is not None and including.packaged):
        src = _packaged(os.path.basename(spec))
        if src is not None:
            return src
        looked.append(f"packaged {os.path.basename(spec)}")
    raise RuleError(
        f"{where}: rule file {spec!r} not found (looked at: {', '.join(looked)}); "
        f"packaged rule files: {', '.join(packaged_files())}"
    )


# ---------------------------------------------------------------------------------------------- parsing


def load_rules(spec: Union[str, os.PathLike, RuleSet, Sequence[Any]]) -> RuleSet:
    """Load rules from a path, a packaged name (``"qwen3_moe"`` or ``"qwen3_moe.yaml"``), a RuleSet, or a list of
    those (concatenated in order: earlier files win)."""
    if isinstance(spec, RuleSet):
        return spec
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    rules: list[Rule] = []
    sources: list[str] = []
    for one in specs:
        if isinstance(one, RuleSet):
            rules.extend(one.rules)
            sources.extend(one.sources)
        else:
            rules.extend(_load_file(_resolve(one, None, "load_rules"), (), sources))
    return RuleSet(tuple(rules), tuple(sources))


def parse_rules(text: str, source: str = "<string>") -> RuleSet:
    """Parse rules from YAML text (includes resolve against the current directory, then packaged files)."""
    sources: list[str] = [source]
    src = _Source(f"text:{source}", source, Path(os.getcwd()) / "<string>", False)
    return RuleSet(tuple(_parse(text, src, (src.key,), sources)), tuple(sources))


def rules_for_model(model_or_config: Any) -> RuleSet:
    """The packaged rules for a model (or its config), chosen by ``config.model_type``."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise RuleError(
            f"no packaged rule file for model_type {model_type!r}; supported families: "
            f"{', '.join(supported_families())}. ktinject moves the routed experts of Mixture-of-Experts models to "
            f"the CPU; for another MoE family write a rule file (docs/rules.md) and pass it: "
            f"inject(model, 'my_rules.yaml'), or --rules my_rules.yaml to the chat and the server"
        )
    return load_rules(FAMILIES[model_type])


def _load_file(src: _Source, stack: tuple[str, ...], sources: list[str]) -> list[Rule]:
    if src.key in stack:
        chain = " -> ".join([k.split(":", 1)[1] for k in stack] + [src.key.split(":", 1)[1]])
        raise RuleError(f"{src.display}: include cycle: {chain}")
    try:
        text = src.path.read_text(encoding="utf-8")
    except OSError as e:
        raise RuleError(f"{src.display}: cannot read the rule file: {e}") from e
    sources.append(src.display)
    log.debug("loading rules from %s", src.display)
    return _parse(text, src, stack + (src.key,), sources)


def _parse(text: str, src: _Source, stack: tuple[str, ...], sources: list[str]) -> list[Rule]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        detail = str(e).replace('"<unicode string>"', src.display)
        raise RuleError(f"{src.display}: {line}YAML syntax error: {detail}") from e
    if root is None:
        raise RuleError(f"{src.display}: the file is empty; expected a YAML list of rules (- match: ...)")
    if not isinstance(root, yaml.SequenceNode) or not isinstance(data, list):
        raise RuleError(
            f"{src.display}: line {root.start_mark.line + 1}: expected a YAML list of rules (- match: ...), "
            f"got a {type(data).__name__}"
        )
    rules: list[Rule] = []
    for index, (item, node) in enumerate(zip(data, root.value)):
        where = f"{src.display}: rule[{index}] (line {node.start_mark.line + 1})"
        _check_duplicate_keys(node, where)
        if isinstance(item, dict) and "include" in item:
            if len(item) != 1:
                others = sorted(k for k in item if k != "include")
                raise RuleError(f"{where}: 'include' must stand alone in its item; move {others} to a rule")
            rules.extend(_load_file(_resolve(item["include"], src, where), stack, sources))
        else:
            rules.append(_parse_rule(item, node, src.display, index))
    return rules


def _check_duplicate_keys(node: yaml.Node, where: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key, value in node.value:
        if key.value in seen:
            raise RuleError(f"{where}: key {key.value!r} (line {key.start_mark.line + 1}) appears twice")
        seen.add(key.value)
        _check_duplicate_keys(value, where)


def _key_line(node: yaml.Node, key: str) -> int:
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if k.value == key:
                return k.start_mark.line + 1
    return node.start_mark.line + 1


def _parse_rule(item: Any, node: yaml.Node, display: str, index: int) -> Rule:
    def fail(key: str | None, msg: str) -> RuleError:
        line = _key_line(node, key) if key else node.start_mark.line + 1
        at = f" key {key!r}:" if key else ""
        return RuleError(f"{display}: rule[{index}] (line {line}):{at} {msg}")

    if not isinstance(item, dict):
        raise fail(None, f"expected a mapping with keys {', '.join(RULE_KEYS)} (or 'include: FILE'), "
                         f"got a {type(item).__name__}: {item!r}")
    unknown = [k for k in item if k not in RULE_KEYS]
    if unknown:
        raise fail(str(unknown[0]), f"unknown key; allowed keys: {', '.join(RULE_KEYS)} (or 'include: FILE' alone)")
    if "match" not in item:
        raise fail(None, "missing key 'match': every rule needs match: {name: REGEX} and/or {class: CLASS}")
    name, cls = _parse_match(item["match"], fail)
    replace = item.get("replace")
    if replace is not None and (not isinstance(replace, str) or not replace.strip()):
        raise fail("replace", f"expected an operator id (a string), got {replace!r}")
    kwargs = item.get("kwargs", {})
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise fail("kwargs", f"expected a mapping of keyword arguments with string keys, got {kwargs!r}")
    if kwargs and replace is None:
        raise fail("kwargs", "kwargs go to an operator: add 'replace: OPERATOR' or drop kwargs")
    device = item.get("device")
    if device is not None and (not isinstance(device, str) or not _DEVICE_RE.fullmatch(device)):
        raise fail("device", f"expected a device variable (gpu, cpu, ...) or a torch device string such as "
                             f"'cuda:0', got {device!r}")
    recursive = item.get("recursive", True)
    if not isinstance(recursive, bool):
        raise fail("recursive", f"expected true or false, got {recursive!r}")
    if replace is None and device is None:
        raise fail(None, "a rule needs 'replace: OPERATOR' or 'device: DEVICE' (or both)")
    return Rule(name, cls, replace, kwargs, device, recursive, display, index, node.start_mark.line + 1)


def _parse_match(match: Any, fail) -> tuple[str | None, str | None]:
    if not isinstance(match, dict) or not match:
        raise fail("match", f"expected a mapping with 'name: REGEX' and/or 'class: CLASS', got {match!r}")
    unknown = [k for k in match if k not in MATCH_KEYS]
    if unknown:
        raise fail("match", f"unknown key {unknown[0]!r} in match; allowed: {', '.join(MATCH_KEYS)}")
    name, cls = match.get("name"), match.get("class")
    if "name" in match:
        if not isinstance(name, str):
            raise fail("match", f"match.name must be a string (a regular expression; quote it), got {name!r}")
        try:
            re.compile(name)
        except re.error as e:
            raise fail("match", f"match.name {name!r} is not a valid regular expression: {e}") from e
    if "class" in match and (not isinstance(cls, str) or not _CLASS_RE.fullmatch(cls)):
        raise fail("match", f"match.class must be a class name or dotted path such as "
                            f"'Qwen3MoeSparseMoeBlock', got {cls!r}")
    return name, cls
