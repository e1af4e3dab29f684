"""GPU-resident ("hot") routed experts: the room for everything that puts routed experts on the GPU.

    settings.py   the validated options (budget, strategy, stats, rebalance interval) every entry point shares
    stats.py      expert activation statistics: counting, reading, saving, loading
    placement.py  choosing the experts within a byte budget (pure) and applying the choice (``place``)
    bank.py       one layer's bank of GPU slots and its graph-capturable compute (``HotExperts``)
    rebalance.py  re-placement while decoding (``Rebalancer``)
    upload.py     moving packed experts from native memory onto the device (a bank slot; streamed prefill)
    policy.py     prefill: the cost model of CPU / GPU / split and its choices (pure)
    costs.py      prefill: measuring the cost model's numbers on the machine
    ring.py       prefill: two device slots of packed experts filled on a copy stream
    stream.py     prefill with routed experts streamed to the GPU (``PrefillStreamer``), alone or split with the CPU

This package builds on ``ktinject.operators`` (it drives the ``HybridMoE`` blocks); the operators never import it.
Nothing is imported here: ``from ktinject.gpu_experts import placement``.
"""
