"""Prefix cache keys and lookup as pure functions: chained block keys, longest-prefix hits, root keys that differ
whenever what the cached values depend on differs."""
from __future__ import annotations

import pytest

from ktinject.decode.prefix_cache import keys

ROOT = keys.root_key({"model": "m"})
STORED = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three blocks of 4


def _hit_tokens(prompt, stored=STORED, block=4, root=ROOT):
    held = set(keys.block_keys(stored, block, root))
    n = keys.hit_blocks(keys.block_keys(prompt[:keys.usable_hit_tokens(len(prompt), len(prompt)) // block * block],
                                        block, root), held.__contains__)
    return n * block


@pytest.mark.parametrize("prompt, expected", [
    (STORED + [13], 12),                       # all three blocks, the new token computed
    (STORED, 8),                               # the prompt's last token is always computed: two blocks
    (STORED[:9], 8),                           # a partial third block
    (STORED[:3], 0),                           # shorter than a block
    ([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13], 4),  # differs in block 2: only block 1
    ([9, 2, 3, 4] + STORED[4:] + [13], 0),     # differs in block 1: later equal blocks do not count (chained)
    (STORED[4:] + [13], 0),                    # the same tokens at other positions are other blocks
    ([], 0),
])
def test_hit_lengths(prompt, expected):
    assert _hit_tokens(prompt) == expected


def test_keys_chain_over_every_token_before():
    a = keys.block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    b = keys.block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert keys.block_keys([1, 2, 3, 4, 5, 6, 7], 4, ROOT) == a[:1]  # a partial block has no key


@pytest.mark.parametrize("change", [
    {"model": "other"}, {"rules": "int4"}, {"experts": "fp8"}, {"dtype": "bfloat16"}, {"block_size": 8},
])
def test_root_keys_differ_when_what_values_depend_on_differs(change):
    base = {"model": "m", "rules": "default", "experts": "int4", "dtype": "float32", "block_size": 4}
    assert keys.root_key(base) == keys.root_key(dict(reversed(list(base.items()))))  # order does not matter
    other = keys.root_key({**base, **change})
    assert other != keys.root_key(base)
    assert keys.block_keys([1, 2, 3, 4], 4, other) != keys.block_keys([1, 2, 3, 4], 4, keys.root_key(base))


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        keys.block_keys([1], 0, ROOT)


def test_model_identity_differs_by_weights_format_and_rules():
    """The root key of a model changes with its weights (seed), its family and its expert format."""
    import ktinject
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.tiny_models import build_tiny_model

    cache = PrefixCache(device="cpu", tier="ram", block_size=4)
    a, b, c = build_tiny_model("qwen3_moe"), build_tiny_model("qwen3_moe", seed=1), build_tiny_model("qwen3_moe")
    d = build_tiny_model("qwen3_moe")
    ktinject.inject(c, gpu="cpu")
    ktinject.inject(d, gpu="cpu", quant="int8")
    roots = [cache.root(m) for m in (a, b, c, d)]
    assert len(set(roots)) == 4, roots
    assert cache.root(build_tiny_model("qwen3_moe")) == roots[0]  # the same model: the same key


def test_model_identity_differs_by_routed_expert_values_alone():
    """Two injected models whose only difference is one routed expert's values (held in the native core, not in
    parameters) get different root keys; the same values give the same key."""
    import torch

    import ktinject
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.tiny_models import build_tiny_model

    cache = PrefixCache(device="cpu", tier="ram", block_size=4)
    a, b, c = (build_tiny_model("qwen3_moe") for _ in range(3))
    with torch.no_grad():
        experts = next(m for n, m in b.named_modules() if n.endswith("mlp.experts"))
        experts.gate_up_proj.mul_(-1.0)
    for m in (a, b, c):
        ktinject.inject(m, gpu="cpu")
    assert [n for n, _ in b.named_parameters() if "experts" in n] == []  # the values live in the native core only
    ra, rb, rc = (cache.root(m) for m in (a, b, c))
    assert ra != rb and ra == rc


def test_weights_fingerprint_samples_large_tensors_in_bounds():
    """Sample indices of a tensor past 2^24 elements stay in bounds and include the last element."""
    import torch
    from torch import nn

    from ktinject.decode.prefix_cache import store

    big = nn.Module()
    big.w = nn.Parameter(torch.arange(2**25 + 7, dtype=torch.int32), requires_grad=False)
    (name, dtype, shape, sample), = store._weights_fingerprint(big)
    assert name == "w" and shape == (2**25 + 7,) and len(sample) == 64
    assert sample[0] == 0 and sample[-1] == 2**25 + 6 and sample == sorted(sample)
