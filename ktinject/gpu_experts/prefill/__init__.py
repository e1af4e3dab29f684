"""Prefill with routed experts on the GPU: a prompt's experts streamed over PCIe as stored, alone or split with the
CPU's native kernels.

    policy.py     the cost model of cpu / gpu / split / ahead and its choices (pure)
    measure.py    measuring the cost model's numbers on the machine
    feedback.py   correcting the model by what split and ahead layers measure as they run; trials between modes
    streamer.py   ``PrefillStreamer``: per forward, which mode; per layer, what goes where; holds the two parts below
    device.py     ``StreamedExperts``, its device part: copies through the ring, dequantization, grouped matmuls, memory
    ring.py       two device slots of packed experts filled on a copy stream
    split.py      ``SplitLayers``, its shared-layers part: layers split between the GPU and the CPU (gated tasks)
    host_io.py    activations between the GPU and the CPU's pinned buffers by small kernels, not copies
"""
