"""Everything that puts routed experts on the GPU: resident ("hot") experts and streamed prefill.

    hot/       GPU-resident ("hot") experts: options, activation statistics, placement within a byte budget,
               each layer's bank of GPU slots, re-placement while decoding, uploads of packed experts
    prefill/   prefill with a prompt's routed experts streamed to the GPU, alone or split with the CPU

This package builds on ``ktinject.operators`` (it drives the ``HybridMoE`` blocks); the operators never import it.
Nothing is imported here: ``from ktinject.gpu_experts.hot import placement``.
"""
