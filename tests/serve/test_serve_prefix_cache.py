"""The server's shared prefix cache on the CPU: a request whose prompt starts like an earlier one restores those
positions (whole blocks) and prefills only the rest, with the greedy tokens of the cache off; its replies report
``usage.prompt_tokens_details.cached_tokens`` (plain and streamed), ``/metrics`` the store's counters; a model the
cache cannot take serves with 0 cached tokens; the serve CLI's --prefix-cache options."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

import ktinject
from ktinject.decode.prefix_cache import PrefixCache
from ktinject.serve.engine import Engine, EngineConfig
from ktinject.serve.sampling import SamplingParams
from ktinject.serve.scheduler import Scheduler
from ktinject.tiny_models import build_tiny_model, tiny_prompts

BLOCK = 4


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cpu")
    yield m
    torch.set_num_threads(threads)


def _run(model, prompts, store, **cfg):
    config = EngineConfig(**{"max_batch": 2, "max_context": 128, "prefill_chunk": 16, "prefix_cache": store, **cfg})
    with Engine(model, None, config) as engine:
        return [engine.generate(p, _greedy(), timeout=120) for p in prompts], engine


def test_a_shared_prefix_is_restored_and_greedy_tokens_equal_the_cache_off(tiny):
    p = tiny_prompts(1, 40, seed=1)[0].tolist()
    q = p[:30] + tiny_prompts(1, 7, seed=2)[0].tolist()  # shares 30 tokens: 7 whole blocks
    plain, _ = _run(tiny, [p, q, p], None)
    store = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    cached, engine = _run(tiny, [p, q, p], store)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert [r.cached_tokens for r in plain] == [0, 0, 0]
    # the first computes everything; q restores its 7 shared blocks; p again all its whole blocks but the last token's
    assert [r.cached_tokens for r in cached] == [0, 28, 36]
    assert store.stats.hit_tokens == 64 and store.stats.lookups == 3
    assert engine.metrics.prompt_tokens == 40 + (37 - 28) + (40 - 36)  # only what was computed is prefilled
    text = engine.metrics.render(0, 0, 2)
    assert "ktinject_prefix_cache_hit_tokens_total 64" in text
    assert "ktinject_prefix_cache_lookups_total 3" in text
    assert 'ktinject_prefix_cache_hits_total{tier="ram"} 16' in text
    assert f'ktinject_prefix_cache_blocks{{tier="ram"}} {store.tiers.all[0].stats.blocks}' in text
    assert 'ktinject_prefix_cache_bytes{tier="ram"} ' in text


def test_a_hit_in_a_shared_prefill_forward_and_a_long_chunked_rest(tiny):
    """Short prompts share a forward from their own starts; a long rest is prefilled in chunks after the hit."""
    base = tiny_prompts(1, 12, seed=5)[0].tolist()
    a, b = base + [7, 8, 9, 10, 11], base + [12, 13, 14, 15, 16, 17]
    long = base + tiny_prompts(1, 50, seed=6)[0].tolist()
    prompts = [base + [3], a, b, long]
    store = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    config = EngineConfig(max_batch=4, max_context=128, prefill_chunk=16, prefix_cache=store)
    with Engine(tiny, None, config) as engine:
        engine.generate(prompts[0], _greedy(), timeout=120)
        reqs, done = [], []
        for p in prompts[1:]:  # together: a and b share one forward, both starting at the cached 12
            ev = threading.Event()
            parts: list = []
            reqs.append(engine.submit(p, _greedy(), lambda o, parts=parts, ev=ev: (parts.append(o), o.finish_reason
                                                                                  and ev.set())))
            done.append((ev, parts))
        for ev, _ in done:
            assert ev.wait(120)
        got = [[t for o in parts for t in o.token_ids] for _, parts in done]
        assert [parts[-1].cached_tokens for _, parts in done] == [12, 12, 12]
    plain, _ = _run(tiny, prompts[1:], None, max_batch=4)
    assert got == [r.token_ids for r in plain]


def test_a_model_the_cache_cannot_take_serves_with_no_cached_tokens(tiny, monkeypatch, caplog):
    from ktinject.decode.prefix_cache import store as store_module

    why = "prefix cache off for Qwen3MoeForCausalLM: a test says so; every prompt is prefilled whole"
    monkeypatch.setattr(store_module, "uncacheable_reason", lambda model: why)
    p = tiny_prompts(1, 20, seed=3)[0].tolist()
    store = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    caplog.set_level("WARNING", logger="ktinject.serve")
    results, engine = _run(tiny, [p, p], store)
    assert [r.cached_tokens for r in results] == [0, 0] and results[0].token_ids == results[1].token_ids
    assert results[0].finish_reason == "length"
    assert why in caplog.text and store.stats.hit_tokens == 0 and store.stats.inserted_blocks == 0
    assert "ktinject_prefix_cache_hit_tokens_total 0" in engine.metrics.render(0, 0, 2)


def test_the_scheduler_starts_a_prefill_after_the_reused_tokens():
    class Seq:
        def __init__(self, n, reused):
            self.prompt_len, self.reused = n, reused

    s = Scheduler(4, 8)
    s.reuse = lambda seq: seq.reused
    long, short = Seq(40, 24), Seq(10, 8)
    s.submit(long)
    s.submit(short)
    jobs = s.next_prefill(16, 16)
    assert [(j.start, j.end, j.fresh) for j in jobs] == [(24, 32, False)]  # to the next chunk boundary
    s.prefilled(jobs)
    jobs = s.next_prefill(16, 16)
    assert [(j.start, j.end) for j in jobs] == [(32, 40)]
    s.prefilled(jobs)
    # the short one: a lone 2-token rest (below MIN_SHARED it would not share a forward, but it is alone)
    jobs = s.next_prefill(16, 16)
    assert [(j.row, j.start, j.end) for j in jobs] == [(1, 8, 10)]
    s.prefilled(jobs)
    s.check()


# ---- the OpenAI API on the demo model ----------------------------------------------------------------------------
def _free_server(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    return server, thread, sock


@pytest.fixture(scope="module")
def demo_api(demo_engine_model):
    """``serve(store)``: a context of (engine, url) of the demo model with ``store`` (one engine at a time: engines of
    one model share its GraphRunner)."""
    import contextlib

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from ktinject.serve.api import create_app

    model, tokenizer = demo_engine_model

    @contextlib.contextmanager
    def serve(store):
        config = EngineConfig(max_batch=2, max_context=512, prefill_chunk=64, prefix_cache=store)
        engine = Engine(model, tokenizer, config, name="demo").start()
        server, thread, sock = _free_server(create_app(engine, "demo"))
        host, port = sock.getsockname()
        try:
            yield engine, f"http://{host}:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
            engine.stop()
            sock.close()

    return httpx, serve


SYSTEM = ("You are a patient storyteller. The small robot wanted to learn to paint by the sea in a quiet town, and "
          "every morning it walked along the shore to look at the colours of the water and the sky. ") * 3


def _chat(httpx, url, question, stream=False):
    body = {"model": "demo", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return text, chunks[-1]["usage"]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def test_api_replies_report_cached_tokens_and_metrics_count_them(demo_api):
    httpx, serve = demo_api
    questions = ["What did it paint?", "Where did it walk?", "Where did it walk?"]
    with serve(None) as (_, url):
        plain = [_chat(httpx, url, q) for q in questions]
        assert "prefix_cache" not in httpx.get(f"{url}/metrics").text
    assert all(use["prompt_tokens_details"] == {"cached_tokens": 0} for _, use in plain)
    store = PrefixCache(device="cpu", tier="ram", block_size=16)
    with serve(store) as (_, url):
        first_text, first = _chat(httpx, url, questions[0])
        second_text, second = _chat(httpx, url, questions[1])
        third_text, third = _chat(httpx, url, questions[2], stream=True)  # the final usage chunk
        prompt = SYSTEM + "Once upon a time"
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 3,
                                                          "temperature": 0}, timeout=120)
        completion = r.json()["usage"]
        metrics = httpx.get(f"{url}/metrics").text
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    for use in (second, third, completion):
        cached = use["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < use["prompt_tokens"] and cached % 16 == 0, use
    assert third["prompt_tokens_details"]["cached_tokens"] >= second["prompt_tokens_details"]["cached_tokens"]
    assert [first_text, second_text, third_text] == [text for text, _ in plain]  # greedy text: the cache off's
    hit = store.stats.hit_tokens
    assert hit == sum(u["prompt_tokens_details"]["cached_tokens"] for u in (second, third, completion))
    assert f"ktinject_prefix_cache_hit_tokens_total {hit}" in metrics
    assert f"ktinject_prefix_cache_lookups_total {store.stats.lookups}" in metrics and store.stats.lookups == 5
    assert f'ktinject_prefix_cache_hits_total{{tier="ram"}} {hit // 16}' in metrics
    assert f'ktinject_prefix_cache_blocks{{tier="ram"}} {store.tiers.all[0].stats.blocks}' in metrics
    assert 'ktinject_prefix_cache_bytes{tier="ram"} ' in metrics


# ---- the serve CLI -------------------------------------------------------------------------------------------------
def test_serve_cli_prefix_cache_options():
    from ktinject.cli import options
    from ktinject.cli.serve import build_parser

    args = build_parser().parse_args([])
    assert args.prefix_cache == "ram"
    store = options.make_prefix_cache(args, "cpu")
    assert store.tier == "ram" and store.block_size == 256 and not store.keep_generated
    args = build_parser().parse_args(["--prefix-cache", "off"])
    assert options.make_prefix_cache(args, "cpu") is None
    args = build_parser().parse_args(["--prefix-cache", "gpu", "--prefix-cache-gpu", "1GiB", "--prefix-block", "16"])
    assert (args.prefix_cache, args.prefix_cache_gpu, args.prefix_block) == ("gpu", 2**30, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-cache", "ssd"])


def test_n_choices_prefill_their_prompt_once(demo_api):
    """n = 3 with the prefix cache: choice 0 prefills the prompt, choices 1 and 2 restore its whole blocks (only the
    last partial block is computed again), and each gets what a request of n = 1 gets (greedy)."""
    httpx, serve = demo_api
    body = {"model": "demo", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What did it paint?"}]}
    store = PrefixCache(device="cpu", tier="ram", block_size=16)
    with serve(store) as (engine, url):
        before = engine.metrics.prompt_tokens
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 3}, timeout=120)
        assert r.status_code == 200, r.text
        prefilled = engine.metrics.prompt_tokens - before
        one = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    use = r.json()["usage"]
    prompt = use["prompt_tokens"]
    whole = prompt - 1 - (prompt - 1) % 16  # the blocks a later request restores (its last token is computed)
    assert prefilled == prompt + 2 * (prompt - whole), (prefilled, prompt)
    assert use["completion_tokens"] == 12 and use["total_tokens"] == prompt + 12
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert texts == [one["choices"][0]["message"]["content"]] * 3
