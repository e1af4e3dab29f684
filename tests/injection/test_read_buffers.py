"""The loader's read-buffer pool and its packer threads' memory: buffers of a size are reused, kept buffers of other
sizes are let go before a new one would pass the pool's limit (the peak stays within resident + about one window),
and a packing job's C-heap temporaries are handed back to the OS after it (malloc_trim, where glibc has it)."""
from __future__ import annotations

import torch

from ktinject.injection import expert_packing
from ktinject.injection.formats.base import BufferPool


def test_a_kept_buffer_of_the_size_is_reused():
    pool = BufferPool(limit=1000)
    a = pool.get(300)
    pool.put(a)
    assert pool.get(300).data_ptr() == a.data_ptr()


def test_kept_buffers_of_other_sizes_go_before_a_new_one_passes_the_limit():
    pool = BufferPool(limit=1000)
    small, big = pool.get(300), pool.get(600)
    pool.put(small)
    pool.put(big)
    assert pool._kept == 900
    c = pool.get(500)  # 900 kept + 500 > 1000: the largest kept (600) goes, the 300 stays
    assert c.numel() == 500 and pool._kept == 300 and pool.get(300).data_ptr() == small.data_ptr()
    pool.put(c)
    d = pool.get(800)  # 500 kept + 800 > 1000: the 500 goes too
    assert d.numel() == 800 and pool._kept == 0


def test_unlimited_pool_keeps_everything():
    pool = BufferPool()
    for n in (10, 20, 30):
        pool.put(torch.empty(n, dtype=torch.uint8))
    pool.get(40)
    assert pool._kept == 60


def test_packer_runs_every_job_and_trims_after_each(monkeypatch):
    calls = []
    monkeypatch.setattr(expert_packing, "_malloc_trim", lambda: (lambda pad: calls.append(pad)))
    monkeypatch.setenv("KTINJECT_PACK_THREADS", "2")
    packer = expert_packing.Packer()
    done = []
    for i in range(5):
        packer.submit(done.append, i)
    packer.drain()
    packer.close()
    assert sorted(done) == [0, 1, 2, 3, 4] and calls == [0] * 5


def test_malloc_trim_is_found_on_glibc_or_absent():
    trim = expert_packing._malloc_trim()
    assert trim is None or trim(0) in (0, 1)
