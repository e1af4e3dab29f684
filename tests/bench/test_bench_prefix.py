"""The prefix cache benches on the tiny model (the code paths on a CPU): bench prefix's tiers restore whole blocks
and give cold's first token; bench agents' run with a shared cache restores the shared context and replies as
without it."""
from __future__ import annotations

from ktinject.bench import agents, prefix


def test_prefix_bench_restores_whole_blocks_from_each_tier(capsys, tmp_path):
    assert prefix.main(["--tiny", "--history", "100", "--new", "7", "--block", "32", "--reps", "1",
                        "--disk-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("# ram", "# disk"))]
    assert len(lines) == 2, out
    for ln in lines:
        assert "96 tokens restored" in ln and "DIFFERS" not in ln, ln
    assert "cold prefill" in out and "KB a token" in out


def test_prefix_bench_rejects_a_history_shorter_than_a_block():
    import pytest

    with pytest.raises(SystemExit, match="at least one block"):
        prefix.main(["--tiny", "--history", "10", "--block", "32"])


def test_page_cache_drop_and_cold_read_cover_every_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"1" * 5000)
    (tmp_path / "y.bin").write_bytes(b"2" * 3000)
    assert prefix.drop_page_cache(tmp_path) in (True, False)
    rate, total = prefix.disk_read_bound(tmp_path)
    assert total == 8000 and rate > 0


def test_agents_bench_shares_the_context_and_replies_as_without(capsys):
    assert agents.main(["--tiny", "--clients", "2", "--shared", "64", "--turns", "2", "--message", "5",
                        "--reply", "4", "--block", "16", "--prefill-chunk", "64"]) == 0
    out = capsys.readouterr().out
    off = next(ln for ln in out.splitlines() if ln.startswith("# prefix cache off"))
    on = next(ln for ln in out.splitlines() if ln.startswith("# prefix cache ram"))
    assert "0 of" in off
    assert not on.split(": ", 1)[1].split("; ")[2].startswith("0 of"), on
    assert "replies equal: 4 of 4" in out
