"""Triton kernels on CUDA, each with its torch reference: ``common.py`` (availability, the router's top-k, the
decode handshake's words and copies), ``attention.py`` (q/k norm + rotary + cache write, attention over the static
cache), ``dense.py`` (residual add + RMSNorm, fused projections), ``dequant.py`` (int8 / int4 experts unpacked to
bf16, for hot-expert uploads and streamed prefill)."""
