"""``ktinject.serve``: an OpenAI-compatible server with continuous batching (``python -m ktinject.serve``).

- ``engine.py``: the engine, what other threads call (``Engine``, ``EngineConfig``, ``SamplingParams``); knows
  nothing about HTTP. ``loop.py``: its thread, which owns the model (per step: cancellations, chunked prefill, one
  batched decode step of every running request, queued before the tokens of the step before are read);
  ``steps.py``: the forwards on the model.
- ``scheduler.py``: KV-cache rows and admission (pure bookkeeping); ``sampling.py``: per-row sampling;
  ``text.py``: incremental detokenization and stop strings; ``metrics.py``: counters and Prometheus text.
- ``protocol.py``: OpenAI request/response bodies; ``api.py``: the FastAPI app; ``__main__.py``: the CLI.

Nothing is imported here (FastAPI and uvicorn are the ``serve`` extra; torch loads with the engine).
"""
