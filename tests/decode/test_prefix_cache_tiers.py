"""Prefix cache tiers: eviction down a tier under byte budgets, promotion of a lower hit, the disk tier across a
restart, and damaged, truncated and foreign disk blocks rejected (dropped, then recomputed)."""
from __future__ import annotations

import pytest
import torch

from ktinject.decode.prefix_cache import disk_format
from ktinject.decode.prefix_cache.tiers import DiskTier, MemoryTier, Tiers


def _block(value: float, n: int = 16) -> dict:
    return {"k.0": torch.full((n,), float(value)), "v.0": torch.full((n,), -float(value))}  # 2 x 64 bytes


BLOCK = 128


def test_lru_blocks_move_down_and_fall_off_the_last_memory_tier():
    top, low = MemoryTier("gpu", "cpu", 2 * BLOCK), MemoryTier("ram", "cpu", 2 * BLOCK)
    tiers = Tiers([top, low])
    for i in range(5):
        tiers.put(f"k{i}", _block(i))
    assert list(top.blocks) == ["k3", "k4"] and list(low.blocks) == ["k1", "k2"]  # k0 dropped
    assert not tiers.holds("k0") and top.stats.bytes == low.stats.bytes == 2 * BLOCK


def test_a_hit_lower_down_is_copied_up_and_refreshed():
    top, low = MemoryTier("gpu", "cpu", 2 * BLOCK), MemoryTier("ram", "cpu", 2 * BLOCK)
    tiers = Tiers([top, low])
    for i in range(4):
        tiers.put(f"k{i}", _block(i))
    block, where = tiers.get("k0")
    assert where == "ram" and torch.equal(block["k.0"], torch.zeros(16))
    assert "k0" in top.blocks and "k0" not in low.blocks  # promoted; the top's oldest went down
    assert list(top.blocks) == ["k3", "k0"] and set(low.blocks) == {"k1", "k2"}


def test_a_block_over_a_budget_goes_down_at_once():
    top, low = MemoryTier("gpu", "cpu", BLOCK // 2), MemoryTier("ram", "cpu", 4 * BLOCK)
    Tiers([top, low]).put("big", _block(1))
    assert not top.blocks and "big" in low.blocks


def test_negative_budget_is_an_error():
    with pytest.raises(ValueError, match="budget must be >= 0"):
        MemoryTier("ram", "cpu", -1)


def test_disk_tier_survives_a_restart_and_keeps_its_budget(tmp_path):
    size = len(disk_format.encode("a" * 32, _block(0)))
    disk = DiskTier(tmp_path, 3 * size)
    for i in range(4):
        disk.put(f"{i:032x}", _block(i))
    assert disk.stats.blocks == 3 and f"{0:032x}" not in disk  # the oldest file deleted
    again = DiskTier(tmp_path, 3 * size)
    assert set(again.files) == {f"{i:032x}" for i in (1, 2, 3)}
    assert torch.equal(again.get(f"{2:032x}")["v.0"], torch.full((16,), -2.0))
    smaller = DiskTier(tmp_path, size)  # a smaller budget at start trims the oldest
    assert smaller.stats.blocks == 1


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:-5])
    elif how == "flipped":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif how == "magic":
        path.write_bytes(b"NOTABLOK" + data[8:])
    elif how == "header":
        path.write_bytes(data[:20] + b"\x00" + data[21:])
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "flipped", "magic", "header", "empty", "foreign"])
def test_damaged_truncated_and_foreign_blocks_are_dropped(tmp_path, how, caplog):
    disk = DiskTier(tmp_path, 1 << 20)
    key, other = "ab" + "0" * 30, "cd" + "1" * 30
    disk.put(key, _block(1))
    disk.put(other, _block(2))
    if how == "foreign":  # another block's file under this key's name
        disk.file_of(key).write_bytes(disk.file_of(other).read_bytes())
    else:
        _damage(disk.file_of(key), how)
    restarted = DiskTier(tmp_path, 1 << 20)
    assert key in restarted  # found by name ...
    assert restarted.get(key) is None  # ... but never used
    assert key not in restarted and not restarted.file_of(key).exists() and restarted.stats.rejected == 1
    assert "dropped disk block" in caplog.text
    assert torch.equal(restarted.get(other)["k.0"], torch.full((16,), 2.0))  # the other block is fine
    restarted.put(key, _block(1))  # recomputed: written again, and good
    assert torch.equal(DiskTier(tmp_path, 1 << 20).get(key)["k.0"], torch.ones(16))


def test_the_format_keeps_dtypes_and_shapes():
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.zeros(0, 4),
               "c": torch.arange(3, dtype=torch.int64)}
    back = disk_format.decode(disk_format.encode("k" * 32, tensors), "k" * 32)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    with pytest.raises(disk_format.BlockFileError, match="foreign block"):
        disk_format.decode(disk_format.encode("k" * 32, tensors), "j" * 32)
