"""The tiers of the prefix cache: GPU memory, (page-locked) host RAM, a disk directory, each with a byte budget.

``MemoryTier`` holds blocks (dicts of tensors) on one device in least-recently-used order; ``DiskTier`` holds block
files (``disk_format``) under a directory, found again after a restart, each checked when read. ``Tiers`` stacks
them top (fastest) first: a new block goes to the top; a tier over its budget hands its least recently used blocks
down (the last memory tier drops them); a hit lower down is copied up to the top before use. The disk tier is
written through (every inserted block is written once), so what it holds survives the process whichever memory tier
the block sits in; moving a block down to it is then free.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ktinject.decode.prefix_cache import disk_format

log = logging.getLogger(__name__)
TIER_NAMES = ("gpu", "ram", "disk")


def block_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class TierStats:
    hits: int = 0
    hit_tokens: int = 0
    blocks: int = 0
    bytes: int = 0
    evicted: int = 0
    rejected: int = 0  # disk blocks found damaged, truncated or foreign (dropped)


class MemoryTier:
    """Blocks on ``device`` within ``budget`` bytes; ``pinned``: host tensors page-locked (faster copies to CUDA)."""

    def __init__(self, name: str, device, budget: int, pinned: bool = False):
        if budget < 0:
            raise ValueError(f"prefix cache {name} tier: the budget must be >= 0 bytes, got {budget}")
        self.name, self.device, self.budget, self.pinned = name, torch.device(device), int(budget), pinned
        self.blocks: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, key: str) -> bool:
        return key in self.blocks

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
        return block

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.device, non_blocking=t.is_pinned() or self.device.type == "cuda", copy=True)
        return out.pin_memory() if self.pinned and not out.is_pinned() else out

    def put(self, key: str, block: dict[str, torch.Tensor]) -> list[tuple[str, dict]]:
        """Hold ``block`` (copied here); the blocks pushed out to stay within the budget, oldest first."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return []
        size = block_bytes(block)
        if size > self.budget:
            return [(key, block)]
        self.blocks[key] = {n: self._here(t) for n, t in block.items()}
        self.stats.bytes += size
        self.stats.blocks += 1
        out = []
        while self.stats.bytes > self.budget:
            out.append(self.pop_oldest())
        return out

    def pop_oldest(self) -> tuple[str, dict]:
        key, block = self.blocks.popitem(last=False)
        self.stats.bytes -= block_bytes(block)
        self.stats.blocks -= 1
        self.stats.evicted += 1
        return key, block

    def clear(self) -> None:
        self.blocks.clear()
        self.stats.bytes = self.stats.blocks = 0


class DiskTier:
    """Block files under ``path`` (two-hex-digit subfolders) within ``budget`` bytes; the oldest (by modification
    time, refreshed on each hit) are deleted first. Files already there are found by name; each is checked when
    read, and one that fails (``disk_format.BlockFileError``) is deleted and counted as rejected."""

    name = "disk"

    def __init__(self, path, budget: int):
        if budget < 0:
            raise ValueError(f"prefix cache disk tier: the budget must be >= 0 bytes, got {budget}")
        self.path, self.budget = Path(path).expanduser(), int(budget)
        self.path.mkdir(parents=True, exist_ok=True)
        self.files: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, oldest first
        self.stats = TierStats()
        found = []
        for f in self.path.glob(f"??/*{disk_format.SUFFIX}"):
            try:
                st = f.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, f.stem, st.st_size))
        for _, key, size in sorted(found):
            self.files[key] = size
            self.stats.bytes += size
        self.stats.blocks = len(self.files)
        self._trim()

    def file_of(self, key: str) -> Path:
        return self.path / key[:2] / f"{key}{disk_format.SUFFIX}"

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        if key not in self.files:
            return None
        path = self.file_of(key)
        try:
            block = disk_format.read_block(path, key)
        except (OSError, disk_format.BlockFileError) as e:
            log.warning("prefix cache: dropped disk block %s: %s", path, e)
            self.stats.rejected += 1
            self._drop(key)
            return None
        self.files.move_to_end(key)
        try:
            path.touch()
        except OSError:
            pass
        return block

    def put(self, key: str, block: dict[str, torch.Tensor]) -> list[tuple[str, dict]]:
        if key in self.files:
            self.files.move_to_end(key)
            return []
        try:
            size = disk_format.write_block(self.file_of(key), key, block)
        except OSError as e:
            log.warning("prefix cache: cannot write a block under %s: %s", self.path, e)
            return []
        self.files[key] = size
        self.stats.bytes += size
        self.stats.blocks += 1
        self._trim()
        return []

    def _drop(self, key: str) -> None:
        size = self.files.pop(key, None)
        if size is not None:
            self.stats.bytes -= size
            self.stats.blocks -= 1
        try:
            self.file_of(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("prefix cache: cannot delete %s: %s", self.file_of(key), e)

    def _trim(self) -> None:
        while self.stats.bytes > self.budget and self.files:
            self._drop(next(iter(self.files)))
            self.stats.evicted += 1

    def clear(self) -> None:
        for key in list(self.files):
            self._drop(key)


@dataclass
class Tiers:
    """The tiers, top first (see the module docstring)."""

    memory: list[MemoryTier] = field(default_factory=list)
    disk: DiskTier | None = None

    @property
    def all(self) -> list:
        return [*self.memory, *([self.disk] if self.disk is not None else [])]

    def holds(self, key: str) -> bool:
        return any(key in t for t in self.all)

    def put(self, key: str, block: dict[str, torch.Tensor]) -> None:
        """A new block: into the top memory tier (and written through to disk)."""
        if self.disk is not None:
            self.disk.put(key, block)
        if self.memory:
            self._put_at(0, key, block)

    def _put_at(self, level: int, key: str, block: dict) -> None:
        pending = [(key, block)]
        while pending and level < len(self.memory):
            pushed = []
            for k, b in pending:
                pushed += self.memory[level].put(k, b)
            pending, level = pushed, level + 1
        # past the last memory tier: dropped (the disk tier, if any, already holds each block)

    def get(self, key: str) -> tuple[dict[str, torch.Tensor], str] | None:
        """(block, the tier it was found in); a block found below the top memory tier is copied up to it."""
        for level, tier in enumerate(self.all):
            block = tier.get(key)
            if block is None:
                continue
            if level > 0 and self.memory:
                if level < len(self.memory):
                    self.memory[level].blocks.pop(key)
                    self.memory[level].stats.bytes -= block_bytes(block)
                    self.memory[level].stats.blocks -= 1
                self._put_at(0, key, block)
                block = self.memory[0].get(key) or block
            return block, tier.name
        return None

    def clear(self) -> None:
        for t in self.all:
            t.clear()
