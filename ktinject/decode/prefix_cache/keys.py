"""Block keys as pure functions: a root key of what cached values depend on, then one key per block of tokens,
each chained over the key before it (so a block's key names every token before its end, not only its own).

``root_key(parts)`` digests a JSON-able mapping (model identity, rules, expert format, dtype, versions, block size);
``block_keys(tokens, block_size, root)`` gives the keys of the whole blocks of ``tokens``; ``hit_blocks(keys,
holds)`` counts the leading keys a store holds: the longest cached prefix is that many blocks.
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable, Iterable, Mapping, Sequence

#: the key scheme's version: a change here makes every stored block foreign
KEY_VERSION = 1
DIGEST_BYTES = 16


def root_key(parts: Mapping) -> str:
    """Hex digest of ``parts`` (JSON-serialisable; keys sorted, other values by repr)."""
    blob = json.dumps({"key_version": KEY_VERSION, **parts}, sort_keys=True, default=repr).encode()
    return hashlib.blake2b(blob, digest_size=DIGEST_BYTES).hexdigest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)


def block_keys(tokens: Sequence[int], block_size: int, root: str) -> list[str]:
    """Keys of the whole blocks of ``tokens`` (a trailing partial block has none): key i digests key i-1 (the root
    for block 0) and block i's tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = [int(t) for t in tokens]
    keys, previous = [], bytes.fromhex(root)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(previous, digest_size=DIGEST_BYTES)
        h.update(_token_bytes(tokens[start:start + block_size]))
        previous = h.digest()
        keys.append(previous.hex())
    return keys


def hit_blocks(keys: Iterable[str], holds: Callable[[str], bool]) -> int:
    """How many leading ``keys`` ``holds`` says are stored (the first miss ends the prefix)."""
    n = 0
    for key in keys:
        if not holds(key):
            break
        n += 1
    return n


def usable_hit_tokens(prompt_len: int, hit_tokens: int) -> int:
    """Cached tokens a prompt may reuse: at most ``prompt_len - 1`` (the last prompt token is always computed, its
    logits give the first new token)."""
    return max(0, min(hit_tokens, prompt_len - 1))
