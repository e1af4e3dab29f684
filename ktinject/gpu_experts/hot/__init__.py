"""GPU-resident ("hot") routed experts: the options, activation statistics, placement within a byte budget, each
layer's bank of GPU slots, re-placement while decoding, and the upload of packed experts onto the device.

    settings.py   the validated options (budget, strategy, stats, rebalance interval) every entry point shares
    budget.py     the GPU budget as arithmetic: free memory less the run's needs -> the hot experts' bytes (auto)
    stats.py      expert activation statistics: counting, reading, saving, loading
    placement.py  choosing the experts within a byte budget (pure) and applying the choice (``place``)
    bank.py       one layer's bank of GPU slots and its graph-capturable compute (``HotExperts``)
    rebalance.py  re-placement while decoding (``Rebalancer``)
    upload.py     moving packed experts from native memory onto the device (a bank slot; streamed prefill)
"""
