"""GPU-resident ("hot") routed experts: the room for everything that puts routed experts on the GPU.

    settings.py   the validated options (budget, strategy, stats, rebalance interval) every entry point shares
    stats.py      expert activation statistics: counting, reading, saving, loading
    placement.py  choosing the experts within a byte budget (pure) and applying the choice (``place``)
    bank.py       one layer's bank of GPU slots and its graph-capturable compute (``HotExperts``)
    rebalance.py  re-placement while decoding (``Rebalancer``)
    upload.py     moving one packed expert from native memory into a bank slot

This package builds on ``ktinject.operators`` (it drives the ``HybridMoE`` blocks); the operators never import it.
Nothing is imported here: ``from ktinject.gpu_experts import placement``.
"""
