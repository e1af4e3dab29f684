"""Prefill with routed experts on the GPU: a prompt's experts streamed over PCIe as stored, alone or split with the
CPU's native kernels.

    policy.py     the cost model of cpu / gpu / split / ahead and its choices (pure)
    measure.py    measuring the cost model's numbers on the machine
    feedback.py   correcting the model by what split and ahead layers measure as they run; trials between modes
    streamer.py   ``PrefillStreamer``: per forward, which mode; per layer, what goes where
    device.py     the streamer's device side: copies through the ring, dequantization, grouped matmuls
    ring.py       two device slots of packed experts filled on a copy stream
    split.py      layers shared between the GPU and the CPU (split and ahead; gated tasks)
    dequant.py    Triton kernels that unpack int8 / int4 experts to bf16 on the GPU
    host_io.py    activations between the GPU and the CPU's pinned buffers by small kernels, not copies
"""
