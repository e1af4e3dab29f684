"""Pool.set_profile / Pool.profile (ktk_pool_set_profile, ktk_pool_profile): counts of the jobs and parallel phases
of forwards, nothing while off, sums zeroed by each read; and the forward's results are the same with it on."""
import torch

from ktinject.native import Experts, Pool

H, I, E = 96, 80, 6


def _experts():
    gen = torch.Generator().manual_seed(0)
    return Experts.from_hf(torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen), quant="int8")


def test_profile_counts_jobs_and_phases(monkeypatch):
    ex = _experts()
    x = torch.randn(5, H)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]])
    w = torch.full((5, 2), 0.5)
    with Pool(2) as pool:
        plain = ex.forward(x, ids, w, pool=pool)
        assert pool.profile()["jobs"] == 0  # off by default
        pool.set_profile(True)
        for _ in range(3):
            out = ex.forward(x, ids, w, pool=pool)
        pool.set_profile(False)
        ex.forward(x, ids, w, pool=pool)  # not counted
        prof = pool.profile()
        assert torch.equal(out, plain)
        assert prof["jobs"] == 3
        assert prof["job_us"] > 0 and prof["serial_us"] >= 0
        assert 0 < prof["head_us"] <= prof["serial_us"] + 1e-6  # routing, gather: before the first phase
        assert prof["phases"], prof  # gate/up and down at least (5 tokens x 2 experts: several items each)
        for ph in prof["phases"]:
            assert ph["wall_us"] > 0 and ph["chunks"] >= 1 and ph["busy_us"] >= 0
        assert sum(ph["wall_us"] for ph in prof["phases"]) <= prof["job_us"] + 1e-6
        assert pool.profile()["jobs"] == 0  # read zeroes
        monkeypatch.setenv("KTINJECT_GEMV", "1")  # the decode path wherever the kernels have one
        pool.set_profile(True)
        one = torch.tensor([[0, 1]] * 2 + [[1, 2]])  # 3 tokens, experts 0, 1, 2: at most 2 rows each
        ex.forward(x[:3], one, w[:3], pool=pool)
        prof = pool.profile()
        assert (prof["decode_jobs"], prof["decode_experts"], prof["decode_tokens"]) == (1, 3, 3)
        pool.set_profile(True)
        ex.forward(torch.randn(17, H), torch.zeros(17, 2, dtype=torch.int64) + torch.tensor([0, 1]),
                   torch.full((17, 2), 0.5), pool=pool)  # 17 tokens: a prompt, not a decode step
        assert pool.profile()["decode_jobs"] == 0
        with pool.profiling() as prof:  # the context manager: only the jobs inside the block
            ex.forward(x, ids, w, pool=pool)
        assert prof["jobs"] == 1 and prof["phases"]
        assert pool.profile()["jobs"] == 0  # off again after the block


def test_gather_rows_of_one_token_match_per_row_quantization():
    """A token routed to several experts is quantized once and copied into its rows (moe/gather.c): the output equals
    the sum of each expert alone (its own forward, one row), for many tokens and few (the items' sizes differ)."""
    ex = _experts()
    gen = torch.Generator().manual_seed(1)
    for T in (1, 3, 40):
        x = torch.randn(T, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(T)])
        w = torch.rand(T, 3, generator=gen)
        with Pool(3) as pool:
            got = ex.forward(x, ids, w, pool=pool)
            want = torch.zeros(T, H)
            for j in range(3):
                want += ex.forward(x, ids[:, j:j + 1].contiguous(), w[:, j:j + 1].contiguous(), pool=pool)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # sum order: experts ascending there
