"""A store of computed KV-cache state for token prefixes, in blocks, over GPU / page-locked RAM / disk tiers.

``keys`` (pure): each block of ``block_size`` tokens is keyed by a hash chained over every token before it and over
a root key of what the values depend on (the model, its rules and expert format, dtype, library versions), so the
longest cached prefix of a prompt is the longest run of leading block keys the store holds. ``tiers``: byte-budgeted
tiers with least-recently-used blocks moving down a tier; ``disk_format``: the block file (header, tensors, digest;
no pickle); ``store``: ``PrefixCache`` (lookup, restore into a ``KVCache`` row, insert after a prefill), which
``ktinject.generate(..., prefix_cache=...)`` and a server call.
"""
from ktinject.decode.prefix_cache.store import Hit, PrefixCache, PrefixCacheStats, uncacheable_reason

__all__ = ["Hit", "PrefixCache", "PrefixCacheStats", "uncacheable_reason"]
