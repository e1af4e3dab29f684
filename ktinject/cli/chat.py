"""Chat with a model in the terminal: ``python -m ktinject.chat --model DIR``.

Glue only: load with ktinject, apply the tokenizer's chat template, stream the reply, keep the history, and print
prefill and decode speed after each reply. Without --model it uses the built-in demo model (a tiny MoE trained on fortunes).

Commands: /clear forgets the conversation, /stats prints session totals and which fast paths run, /exit (or
Ctrl-D) quits; Ctrl-C stops the current reply, not the program. --prompt TEXT answers once and exits, the reply alone
on stdout (the banner, the load line and the speed line go to stderr), so it can be piped.

A reply ends at the model's end-of-turn tokens (``ktinject.decode.stop_tokens``: the generation config's and the tokenizer's
end-of-sequence ids, the chat template's end-of-turn token, the end-of-text tokens). What does not fit the model's
context (max_position_embeddings) is refused as the server refuses it: a message that leaves no room for a reply, or
one that with an explicit --max-new-tokens runs past the context (one-shot: an error, exit code 2; interactive: the
message is refused and the session goes on); without --max-new-tokens the reply gets what the context leaves, up to
512 tokens (said when that is less). Old exchanges are dropped from the history to make room, and the chat says how
many.

torch, transformers and the model code are imported inside the functions that need them (seconds of imports), so
--help and the checks of the arguments and paths answer at once; the hot-expert options are checked by the same
(torch-free) code as inject's and from_pretrained's, before the model loads.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from ktinject.cli import lora_option
from ktinject.cli import options as cli
from ktinject.cli.options import CliError, add_prefix_cache_options, load_model, make_prefix_cache, positive
from ktinject.decode.stop_tokens import context_limit, stop_token_ids

__all__ = ["Chat", "CliError", "ContextError", "build_parser", "load_model", "main", "parse_args"]  # CliError,
# load_model: re-exported

PROG = "ktinject.chat"
HELP = ("commands: /clear (forget the conversation), /stats (session totals, fast paths), /exit (or Ctrl-D); "
        "Ctrl-C stops a reply")
DEFAULT_MAX_NEW_TOKENS = 512  # without --max-new-tokens: this, or what the context leaves if that is less


class ContextError(CliError):
    """A message the model's context cannot hold with its reply: refused (one-shot: exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    """The chat's options; docs/chat.md's options table lists each of them (tests/test_readme.py checks it)."""
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description="Chat with a MoE model through ktinject.")
    cli.add_version(p)
    cli.add_model_options(p)
    lora_option.add_lora_option(p)
    p.add_argument("--max-new-tokens", type=positive,
                   help=f"reply length limit (default {DEFAULT_MAX_NEW_TOKENS}, or what the model's context leaves); "
                        f"a prompt that leaves less room is refused")
    p.add_argument("--temperature", type=_temperature,
                   help="sampling temperature >= 0; 0 = greedy (default: the model's)")
    p.add_argument("--top-p", type=_top_p, help="nucleus sampling threshold in (0, 1] (default: the model's)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--prompt", help="answer this one message and exit")
    add_prefix_cache_options(p)
    p.add_argument("-v", "--verbose", action="store_true", help="print the injection plan, logs and tracebacks")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _temperature(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text}")
    return value


def _top_p(text: str) -> float:
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = no nucleus cut), got {text}")
    return value


@dataclass
class Totals:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_tokens: int = 0  # new tokens after the first, the ones the decode time covers
    decode_s: float = 0.0


@dataclass
class Chat:
    """One conversation: the history, generation settings, and speed totals. ``notes``: where the chat says what it
    changed (history dropped, a reply limited by the context); stderr by default."""

    model: object
    tokenizer: object
    args: argparse.Namespace
    messages: list[dict] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)
    notes: object = None
    prefix_cache: object = None  # a ktinject.decode.prefix_cache.PrefixCache (attached to the model), or None

    def __post_init__(self):
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    @property
    def stop_ids(self) -> list[int]:
        """The token ids that end a reply (``ktinject.decode.stop_tokens.stop_token_ids``)."""
        ids = self.__dict__.get("_stop_ids")
        if ids is None:
            ids = self.__dict__["_stop_ids"] = stop_token_ids(self.tokenizer,
                                                              getattr(self.model, "generation_config", None))
        return ids

    def reply(self, text: str, out=sys.stdout, status=None) -> str:
        """Stream the answer to ``text`` to ``out``, add both to the history, print the speed line (to ``status``,
        default ``out``). ContextError (history and totals as they were) where the message cannot fit the context."""
        import torch
        from transformers import StoppingCriteriaList

        self.messages.append({"role": "user", "content": text})
        try:
            ids, max_new = self._encode()
        except ContextError:
            self.messages.pop()
            raise
        device = self.model.get_input_embeddings().weight.device
        stop = _StopFlag()
        streamer = _make_streamer(self.tokenizer, out)
        reused_before = self.prefix_cache.stats.hit_tokens if self.prefix_cache is not None else 0
        t0 = time.perf_counter()
        with _sigint_sets(stop):
            output = self.model.generate(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
                streamer=streamer, stopping_criteria=StoppingCriteriaList([stop]), **self._sampling(max_new))
        t_end = time.perf_counter()
        answer = "".join(streamer.parts)
        print(" [stopped]" if stop.stop else "", file=out, flush=True)
        self.messages.append({"role": "assistant", "content": answer})
        new = int(output.shape[-1] - ids.shape[-1])
        cached = self.prefix_cache.stats.hit_tokens - reused_before if self.prefix_cache is not None else 0
        print(self._account(ids.shape[-1], new, t0, streamer.t_first, t_end, cached), file=status or out, flush=True)
        return answer

    def _tokens(self, add_generation_prompt: bool = True):
        text = self.tokenizer.apply_chat_template(self.messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    def _note(self, text: str) -> None:
        print(f"({text})", file=self.notes or sys.stderr, flush=True)

    def _encode(self):
        """(prompt ids, reply token limit) of the conversation; the oldest exchanges dropped (and said) until the
        prompt and the reply fit the model's context. ContextError where the last message cannot fit by itself; then
        nothing is dropped."""
        limit = context_limit(self.model)
        kept = list(self.messages)
        asked = self.args.max_new_tokens
        want = asked or DEFAULT_MAX_NEW_TOKENS
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        dropped = 0
        while True:
            ids = self._tokens()
            n = ids.shape[-1]
            if limit is None or n + want <= limit or len(self.messages) - first <= 1:
                break
            del self.messages[first:first + 2]  # forget the oldest exchange
            dropped += 2
        system = " with the system prompt" if first else ""
        refused = None
        if limit is not None and n >= limit:
            refused = (f"the message is {n} tokens{system} (chat template included), which leaves no room for a reply "
                       f"in the model's context of {limit} tokens: shorten it")
        elif limit is not None and asked is not None and n + asked > limit:
            refused = (f"the message ({n} tokens{system}, chat template included) plus --max-new-tokens ({asked}) is "
                       f"{n + asked} tokens, more than the model's context of {limit} tokens: shorten it or lower "
                       f"--max-new-tokens to at most {limit - n}")
        if refused:
            self.messages[:] = kept  # refused: the history stays as it was
            raise ContextError(refused)
        if dropped:
            self._note(f"dropped the oldest {dropped} messages ({dropped // 2} exchange{'s' * (dropped > 2)}) of the "
                       f"conversation to fit the model's context of {limit} tokens; {len(self.messages)} kept")
        if limit is None or n + want <= limit:
            return ids, want
        self._note(f"the reply is limited to {limit - n} tokens: the message's {n} tokens fill the rest of the "
                   f"model's context of {limit}")
        return ids, limit - n

    def _sampling(self, max_new_tokens: int) -> dict:
        kw: dict = {"max_new_tokens": max_new_tokens}
        if self.stop_ids:
            kw["eos_token_id"] = self.stop_ids
        if self.tokenizer.pad_token_id is not None:
            kw["pad_token_id"] = self.tokenizer.pad_token_id
        t, p = self.args.temperature, self.args.top_p
        if t is not None and t <= 0:
            kw["do_sample"] = False
        elif t is not None or p is not None:
            kw["do_sample"] = True
            kw.update({k: v for k, v in (("temperature", t), ("top_p", p)) if v is not None})
        return kw

    def _account(self, prompt: int, new: int, t0: float, t_first: float | None, t_end: float,
                 cached: int = 0) -> str:
        """The speed line; ``cached``: prompt tokens restored from the prefix cache (the prefill rate counts the
        tokens computed)."""
        tot = self.totals
        tot.turns += 1
        if t_first is None or new == 0:
            return "[no tokens generated]"
        ttft = t_first - t0
        tot.prompt_tokens, tot.prefill_s = tot.prompt_tokens + prompt, tot.prefill_s + ttft
        tot.cached_tokens += cached
        tot.new_tokens, tot.decode_tokens = tot.new_tokens + new, tot.decode_tokens + new - 1
        tot.decode_s += t_end - t_first
        reused = f" ({cached} cached)" if cached else ""
        return (f"[prefill {prompt} tokens{reused}, {_rate(prompt - cached, ttft)} | "
                f"decode {new} tokens, {_rate(new - 1, t_end - t_first)}]")

    def stats(self) -> str:
        tot = self.totals
        context = self._tokens(add_generation_prompt=False).shape[-1] if self.messages else 0
        return "\n".join([
            f"turns: {tot.turns}, history: {len(self.messages)} messages, {context} tokens",
            f"prefill: {tot.prompt_tokens} tokens ({tot.cached_tokens} from the prefix cache) in "
            f"{tot.prefill_s:.2f} s, {_rate(tot.prompt_tokens - tot.cached_tokens, tot.prefill_s)}",
            f"decode: {tot.new_tokens} tokens in {tot.decode_s:.2f} s, {_rate(tot.decode_tokens, tot.decode_s)}",
            *(self.prefix_cache.describe() if self.prefix_cache is not None else ["prefix cache: off"]),
            *_fast_path_lines(self.model),
        ])


def _prefix_cache_text(model, prefix) -> str:
    """The load line's prefix cache part: its tiers, or why it is off."""
    if prefix is None:
        return "prefix cache off"
    from ktinject.decode.prefix_cache import uncacheable_reason

    reason = uncacheable_reason(model)
    if reason is not None:
        return reason
    return f"prefix cache {'+'.join(t.name for t in prefix.tiers.all)}, blocks of {prefix.block_size} tokens"


def _fast_path_lines(model) -> list[str]:
    """One line per fast path of ``ktinject.info(model)["fast_paths"]``: active, off (with the reason), or not run
    yet (not known before the first reply)."""
    import ktinject

    lines = []
    for name, state in ktinject.info(model)["fast_paths"].items():
        status = {True: "active", False: "off", None: "not run yet"}[state["active"]]
        reason = f" ({state['reason']})" if state["reason"] else ""
        lines.append(f"fast path {name}: {status}{reason}")
    return lines


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if tokens > 0 and seconds > 0 else "n/a tok/s"


class _StopFlag:
    """A StoppingCriteria that stops every sequence once ``stop`` is set (by the SIGINT handler)."""

    def __init__(self):
        self.stop = False

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.full((input_ids.shape[0],), self.stop, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _sigint_sets(flag: _StopFlag):
    def handler(signum, frame):
        flag.stop = True

    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _make_streamer(tokenizer, out):
    """A TextStreamer that writes the reply to ``out`` as it comes and notes when the first new token arrived."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.parts: list[str] = []
            self.t_first: float | None = None

        def put(self, value):
            if self.t_first is None and not self.next_tokens_are_prompt:
                self.t_first = time.perf_counter()
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False):
            self.parts.append(text)
            out.write(text)
            out.flush()

    return Streamer()


def _setup(args: argparse.Namespace) -> str:
    """Logging, threads and the GPU device; returns the device name."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        cli.quiet_transformers()
    return cli.device(args)


def _loop(chat: Chat) -> None:
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    print(HELP)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)")
            continue
        if not line:
            continue
        if not line.startswith("/"):
            try:
                chat.reply(line)
            except ContextError as e:
                print(f"(not sent: {e})", file=sys.stderr, flush=True)
            continue
        command = line.split()[0]
        if command in ("/exit", "/quit"):
            return
        if command == "/clear":
            chat.clear()
            print("(conversation cleared)")
        elif command == "/stats":
            print(chat.stats())
        else:
            print(HELP)


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, _main, parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    # one-shot: stdout carries the reply alone (piped), everything about it goes to stderr
    status = sys.stderr if args.prompt is not None else sys.stdout
    adapter = lora_option.read_adapter(args)
    model_dir, model, tokenizer, gpu, seconds = cli.load(
        args, "Using the ktinject demo model at {path}: a tiny MoE trained on fortune cookies, so expect fortunes.",
        _setup, out=status)
    merged = lora_option.merge(model, adapter, args)
    placed = model.__dict__.get("_ktinject_placement")
    if placed is not None:
        print(placed, file=status)
    defer = cli.defer_format(model)
    prefix = make_prefix_cache(args, gpu, keep_generated=True)  # a follow-up turn resends the reply
    print(f"Loaded {model_dir.name} in {seconds:.2f} s (gpu={gpu}, quant={cli.experts_format(model)}"
          f"{', ' + defer if defer else ''}{lora_option.load_text(args, merged)}, {_prefix_cache_text(model, prefix)}).",
          file=status, flush=True)
    if prefix is not None:
        from ktinject.decode.generate import attach_prefix_cache

        attach_prefix_cache(model, prefix)
    chat = Chat(model, tokenizer, args, prefix_cache=prefix)
    if args.prompt is not None:
        chat.reply(args.prompt, status=sys.stderr)
    else:
        _loop(chat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
