"""The allowed-token masks of one step's grammar rows, on the device: filled on the host by each row's matcher
(``grammar.Matcher.fill``) into pinned memory, copied up without a wait, and applied to the sampler's copy of the
logits (the tokens a grammar forbids at -inf) before the argmax and the sampling, after bias and penalties.

Only rows with a grammar get a mask; a step without one runs none of this (no kernel, no copy). The bitmask is
llguidance's layout: int32 [m, W], W = ceil(V / 32), bit t % 32 of word t // 32 set where token t is allowed.
Two host buffers alternate, as the sampler's staging does: the copy of one step may still be reading one while
the host fills the other.
Legend: m rows with a mask, n rows of the step, V vocabulary, W words of a row's mask.
"""
from __future__ import annotations

import torch


def words(vocab: int) -> int:
    """W: the 32-bit words of one row's mask."""
    return (vocab + 31) // 32


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # per device: bool [256, 8], the bits of each byte, lowest first


def _byte_bits(device: torch.device) -> torch.Tensor:
    table = _BYTE_BITS.get(device)
    if table is None:
        table = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)
        _BYTE_BITS[device] = table
    return table


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask int32 [m, W] -> allowed bool [m, V]: one lookup of each byte's 8 bits (the words are little-endian,
    so bit t % 32 of word t // 32 is bit t % 8 of byte t // 8), cheaper than 32 shifts per word."""
    m = bitmask.shape[0]
    data = bitmask.contiguous().view(torch.uint8).reshape(-1).long()  # [m * W * 4]
    return _byte_bits(bitmask.device).index_select(0, data).view(m, -1)[:, :vocab]


def apply(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (float, the sampler's own copy: changed in place), rows [m] (int64, logits rows) and their
    bitmask [m, W] on the logits' device -> logits, the forbidden tokens of those rows at -inf."""
    allowed = unpack(bitmask, logits.shape[1])  # [m, V]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)


class StepMask:
    """The masks of one step: ``rows`` (logits rows that have one) and ``bits`` (their host bitmask [m, W])."""

    def __init__(self, rows: list[int], bits: torch.Tensor, upload):
        self.rows, self.bits, self._upload = rows, bits, upload

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The masks applied to ``logits`` [n, V] (the sampler's own copy), on its device."""
        rows, bits = self._upload(self)
        return apply(logits, rows, bits)


class GrammarMasks:
    """Host buffers for the masks of up to ``rows`` rows over ``vocab`` tokens, and their upload to ``device``."""

    def __init__(self, rows: int, vocab: int, device):
        self.device, self.vocab = torch.device(device), vocab
        cuda = self.device.type == "cuda"
        self._bits = [torch.zeros((rows, words(vocab)), dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._rows = [torch.zeros(rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._uploaded = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._next = 0

    def fill(self, rows: list[int], matchers: list) -> StepMask | None:
        """The masks of logits rows ``rows``, one matcher each (their state now: after every token sampled so
        far); None where ``rows`` is empty."""
        if not rows:
            return None
        k = self._next
        self._next ^= 1
        if self._uploaded[k] is not None:
            self._uploaded[k].synchronize()  # this buffer's last copy (two steps ago) has run
        bits = self._bits[k][:len(rows)]
        self._rows[k][:len(rows)] = torch.tensor(rows, dtype=torch.long)
        for i, m in enumerate(matchers):
            m.fill(bits, i)
        return StepMask(rows, bits, lambda mask, k=k: self._to_device(mask, k))

    def of(self, reqs) -> StepMask | None:
        """The masks of a step over ``reqs`` (in logits order): rows whose grammar is still going, or None."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.done and not r.matcher.done]
        return self.fill(rows, [reqs[i].matcher for i in rows])

    def _to_device(self, mask: StepMask, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        bits = mask.bits.to(self.device, non_blocking=True)
        rows = self._rows[k][:len(mask.rows)].to(self.device, non_blocking=True)
        if self._uploaded[k] is not None:
            self._uploaded[k].record()
        return rows, bits
