"""Capturing one decode step as CUDA graphs: its static input buffers, the warm-up, the capture in pieces.

``GraphRunner`` (graph_runner.py) decides which steps replay a graph and owns the graphs, the caches and the graphs'
memory pool; what it calls to make a graph is here, with the record it keeps of one (``CapturedGraph``).

Static inputs: a clone of each tensor argument, except the 2D padding mask [B, n] of the tokens so far, held in a
[B, L] buffer whose first n columns each replay fills (``static_input``, ``fill_static``; the rest is masked as
future positions anyway). Capture: warm-up steps on a side stream (as torch requires; they also make the
stream-experts runners and any lazily allocated buffer), with the cache's row lengths and linear-attention states
put back after each (``warm_up``), then the capture itself, which executes nothing (``capture_pieces``), both with
the MoE blocks in stream mode (``ktinject.operators.handshake``). Legend: B batch, L max cache length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ktinject.operators import handshake as stream_experts


@dataclass
class CapturedGraph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static input buffers
    output: Any  # ModelOutput of the captured step (its logits are the static output)
    replays: int = 0
    pools: tuple = ()  # native pools the graph's go flags drive: woken just before each replay


class GraphPieces:
    """A decode step captured as consecutive CUDA graphs (one memory pool), replayed in capture order.

    Launching one graph of a many-layer step (thousands of nodes) takes the host a while, and the GPU starts only
    once the launch is done; in pieces, the GPU runs the first piece while the host launches the rest."""

    def __init__(self, graphs: list):
        self.graphs = graphs

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()


def decoder_layers(model) -> list:
    """The model's decoder layers, or []: the ``layers`` ModuleList of HF's ``get_decoder()`` (the language model of
    an image-text wrapper, whose vision tower comes first and has ``layers`` too), else the first ModuleList named
    ``layers`` with more than one entry."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    held = getattr(decoder, "layers", None)
    if decoder is not model and isinstance(held, torch.nn.ModuleList) and len(held) > 1:
        return list(held)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            return list(module)
    return []


def piece_starts(n_layers: int, pieces: int) -> list[int]:
    """Indices of the layers that begin pieces 2.. when ``n_layers`` layers are cut into ``pieces`` even parts."""
    pieces = max(1, min(int(pieces), n_layers))
    return sorted({round(i * n_layers / pieces) for i in range(1, pieces)} - {0})


def static_input(name: str, value: torch.Tensor, max_len: int) -> torch.Tensor:
    """The static buffer of a graph input: a clone, or for a 2D padding mask [B, n] one of [B, max_len]."""
    if name == "attention_mask" and value.dim() == 2:
        buf = torch.ones((value.shape[0], max_len), dtype=value.dtype, device=value.device)
        fill_static(buf, value)
        return buf
    return value.clone()


def fill_static(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a step's input into its static buffer (a 2D mask [B, n] into the first n columns of [B, L])."""
    if buf.shape == value.shape:
        buf.copy_(value, non_blocking=True)
    else:
        buf[:, : value.shape[1]].copy_(value, non_blocking=True)


def warm_up(forward: Callable, inputs: dict, rest: dict, cache, saved, steps: int, device: torch.device) -> None:
    """``max(steps, 1)`` steps of ``forward`` on the static ``inputs`` and the other arguments ``rest``, on a side
    stream in stream mode, each followed by ``cache.restore_step_state(saved)``."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with stream_experts.stream_mode(), torch.cuda.stream(side):
        for _ in range(max(steps, 1)):
            forward({**inputs, **rest})
            # the warm-up wrote K/V at this step's positions (a replay rewrites them) and advanced the lengths and
            # the linear-attention states (put back: the first replay starts from them)
            cache.restore_step_state(saved)
    torch.cuda.current_stream(device).wait_stream(side)


def capture_pieces(forward: Callable, inputs: dict, rest: dict, layers: list, pieces: int, pool,
                   device: torch.device) -> tuple[GraphPieces, Any]:
    """Capture one step of ``forward`` in stream mode as ``pieces`` graphs cut at the boundaries of the decoder
    ``layers`` (none: one graph), into the graph memory pool ``pool``: (GraphPieces, the step's output)."""
    with stream_experts.stream_mode():
        graphs = [torch.cuda.CUDAGraph()]

        def next_piece(module, args):
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool, capture_error_mode="thread_local")

        handles = [layers[i].register_forward_pre_hook(next_piece)
                   for i in piece_starts(len(layers), pieces)] if layers else []
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    output = forward({**inputs, **rest})
                except BaseException:
                    try:
                        graphs[-1].capture_end()
                    except RuntimeError:  # the failed capture is already invalidated
                        pass
                    raise
                graphs[-1].capture_end()
        finally:
            for h in handles:
                h.remove()
        torch.cuda.current_stream(device).wait_stream(stream)
        return GraphPieces(graphs), output
