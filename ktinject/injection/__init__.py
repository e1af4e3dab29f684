"""Injection: rule files, the plan they produce, applying it to a model, and loading checkpoints into it.

    rules.py      the YAML rule format, matching (a pure function) and the packaged rule files
    plan.py       ``ktinject.plan``: what each module becomes and the bytes each device gets, before anything moves
    apply.py      the one apply path: swap modules for operators, place hot experts, attach the prefill streamer
    inject.py     ``ktinject.inject``: plan then apply, on a loaded or a meta-device model
    loading.py    ``ktinject.from_pretrained``: build on meta, stream the checkpoint into the native layout
    pack_cache.py packed experts kept on disk, checked block by block before use
    formats/      one reader per checkpoint format behind one small interface

Builds on every layer below (operators, gpu_experts, decode). Nothing is imported here.
"""
