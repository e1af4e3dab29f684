"""Triton kernels of the decode step on CUDA, each with its torch reference: ``common.py`` (availability, the
router's top-k, the handshake's words and copies), ``attention.py`` (q/k norm + rotary + cache write, attention
over the static cache), ``dense.py`` (residual add + RMSNorm, fused projections)."""
