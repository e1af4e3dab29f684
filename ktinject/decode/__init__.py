"""The decode runtime: ``generate`` (HF's generate with each decode step replayed as one CUDA graph), the graph
runner, the static KV cache and its per-row layouts, the decode layer and attention fast paths, stop tokens.

Builds on ``ktinject.operators`` and ``ktinject.gpu_experts`` (a prompt's prefill may stream experts); the layers
below never import it. Nothing is imported here: ``from ktinject.decode import generate``.
"""
