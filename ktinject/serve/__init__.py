"""``ktinject.serve``: an OpenAI-compatible server with continuous batching (``python -m ktinject.serve``).

Its modules, each importing only those listed before it:
- ``errors.py``: the errors a caller handles (``RequestError``, ``QueueFull``, ``EngineUnavailable``, ``ApiError``);
  ``types.py``: what the engine takes and gives (``EngineConfig``, ``Request``, ``Output``, ``Result``);
- ``detokenizer.py``: incremental detokenization and stop strings; ``logprobs.py`` and ``penalties.py``: a step's
  token logprobs and the per-row penalty counts, on the device; ``sampling.py``: ``SamplingParams`` and per-row
  sampling on the device; ``scheduler.py``: KV-cache rows and admission (pure bookkeeping); ``metrics.py``: counters
  and Prometheus text; ``tokenizer.py``: prompts tokenized and chats rendered for the engine's callers;
- ``model_runner.py``: the forwards on the model (KV-cache rows, prefill chunks, the batched decode step);
- ``engine.py``: the engine and its loop (``Engine``: schedule -> execute -> update on a thread that owns the model),
  no HTTP;
- ``tool_parsers.py``: tool calls read from a reply's text, one parser per family; ``reasoning.py``: ``<think>``
  blocks split off; ``harmony.py``: gpt-oss's channels (reasoning, content and calls at once); ``chat_output.py``:
  them over a chat reply, whole or streamed (pure text functions);
- ``protocol.py`` and ``logprob_format.py``: OpenAI request/response bodies; ``responses_protocol.py``: its Responses
  API's; ``anthropic_protocol.py``: Anthropic's; ``api_middleware.py`` (the key, body limits) and
  ``api_requests.py`` (a request's choices submitted, their events merged); ``openai_api.py``,
  ``responses_api.py`` and ``anthropic_api.py``: each API's endpoints; ``api.py``: the FastAPI app;
  ``__main__.py``: the CLI.

Nothing is imported here (FastAPI and uvicorn are the ``serve`` extra; torch loads with the engine).
"""
