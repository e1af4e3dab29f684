"""The demo checkpoints: a small trained Qwen3-MoE that ships with the package, and a random one built locally.

`demo_model_dir()` returns the trained model (``ktinject/demo/demo_model/``): 4 layers, hidden 192, 16 experts top-4
(4.4M parameters, bf16), a byte-level BPE tokenizer of 2,048 tokens and a ChatML chat template (<|im_start|>/
<|im_end|>, eos = <|im_end|>), trained on the English text of Debian's `fortunes` package (BSD licence:
LICENSE.fortunes) by ``examples/train_demo_model.py``; ``heldout.txt`` is fortunes it never saw, for
``python -m ktinject.eval``. It answers in fortune-like English. Its files are checked against SHA256SUMS.json
before first use. This is the default model of the chat, the examples and the notebook. `finetune_text()`
(``lighthouse.txt``) is a short original text in the fortunes' style, sayings of a lighthouse keeper, for the
fine-tuning example (``ktinject finetune --model demo --text demo``, docs/finetune.md).

`random_model_dir()` builds a tiny Qwen3-MoE with random weights (4 layers, hidden 256, 8 experts top-2) for tests
that need a quick checkpoint of a fixed shape: it writes gibberish by design. It is built once per spec and cached
under $KTINJECT_CACHE (default ~/.cache/ktinject) as demo-<hash of the spec>/; built in a temporary directory and
renamed into place, so concurrent first uses do not corrupt it, and a changed spec gets a new directory.
Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ktinject import envs

logger = logging.getLogger(__name__)

# Bump FORMAT when the on-disk layout changes in a way the spec below does not capture.
FORMAT = 1
SEED = 1234
MARKER = "ktinject-demo.json"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB = 1024  # requested; the trained vocabulary may be smaller on a short text
# Weights ~ N(0, std); embeddings and printable-token lm_head rows scaled up so that output depends on the input
# and greedy decoding does not repeat one token.
INIT = dict(std=0.02, embed_scale=10.0, head_scale=3.0)

MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
Mixture-of-Experts language models hold hundreds of gigabytes of expert weights but use only a few experts for each
token. A router scores every expert, keeps the top k, and mixes their outputs with the router weights. Attention,
embeddings, norms and routers are small and run on the GPU; the routed experts are large and run on the CPU, close
to the memory that holds them. The hottest experts are copied to the GPU within a budget of bytes.
Hello! How are you today? I am fine, thank you. What can I do for you? Please tell me a story about a small robot
who wanted to learn to paint. Once upon a time, in a quiet town by the sea, there lived a small robot named Bolt.
Every morning Bolt watched the painters on the harbour wall and wondered how colours could hold the light.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14 2.71.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
Question: what is the capital of France? Answer: Paris. Question: how many legs does a spider have? Answer: eight.
The system prompt says: you are a helpful assistant. The user asks a question and the assistant answers it.
The model reads the prompt once (prefill) and then writes one token at a time (decode). Prefill is limited by
compute; decode is limited by how fast the expert weights stream from memory. Quantized weights (int8, int4) are
smaller and therefore faster to read. A graph of the whole decode step replays without Python in the loop.
Good morning. Good night. Thank you very much. You are welcome. See you tomorrow. Have a nice day, my friend.
Bonjour, comment allez-vous? Hallo, wie geht es dir? Hola, como estas? Ciao, come stai?
"""


def _spec() -> dict:
    return {"format": FORMAT, "seed": SEED, "init": INIT, "bpe_vocab": BPE_VOCAB, "special": SPECIAL_TOKENS,
            "model": MODEL, "template": CHAT_TEMPLATE, "corpus": CORPUS}


def _spec_hash() -> str:
    blob = json.dumps(_spec(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_root() -> Path:
    env = envs.get("KTINJECT_CACHE")  # a path (~ expanded), or None when unset or empty
    return Path(env) if env else Path.home() / ".cache" / "ktinject"


TRAINED = Path(__file__).resolve().parent / "demo_model"
_VERIFIED: set[Path] = set()


class DemoModelError(RuntimeError):
    """The packaged demo model is missing or its files do not match their checksums."""


def demo_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The trained demo checkpoint that ships with ktinject (checked against its SHA256SUMS.json once per process).
    ``cache_dir`` is accepted for symmetry with ``random_model_dir`` and unused: nothing is built."""
    path = TRAINED
    if path not in _VERIFIED:
        try:
            sums = json.loads((path / "SHA256SUMS.json").read_text())
        except (OSError, ValueError) as e:
            raise DemoModelError(f"the demo model's SHA256SUMS.json in {path} is missing or unreadable ({e}); "
                                 f"reinstall ktinject") from None
        for name, digest in sums.items():
            try:
                got = hashlib.sha256((path / name).read_bytes()).hexdigest()
            except OSError as e:
                raise DemoModelError(f"demo model file {path / name} is unreadable ({e}); reinstall ktinject") from None
            if got != digest:
                raise DemoModelError(f"demo model file {path / name} does not match its checksum (expected {digest}, "
                                     f"got {got}); reinstall ktinject")
        _VERIFIED.add(path)
    return path


def heldout_text() -> str:
    """Fortunes the demo model never saw in training (for python -m ktinject.eval)."""
    return (demo_model_dir() / "heldout.txt").read_text()


def finetune_text() -> Path:
    """The packaged text of the fine-tuning example: sayings from a lighthouse almanac, in the fortunes' style."""
    return Path(__file__).resolve().parent / "lighthouse.txt"


def random_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the random-weight checkpoint directory, building it on first use (a few seconds).

    cache_dir: the cache root (default $KTINJECT_CACHE or ~/.cache/ktinject); the model lives in <root>/demo-<hash>.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    digest = _spec_hash()
    final = root / f"demo-{digest}"
    if _is_complete(final, digest):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():  # a directory without a valid marker was not made by us: set it aside
        logger.warning("demo model at %s is incomplete; rebuilding it", final)
        _remove_quietly(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{digest}-", dir=root))
    try:
        logger.info("building the ktinject demo model in %s", final)
        _build(tmp)
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "hash": digest}) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors create owner-only files
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not _is_complete(final, digest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(path: Path, digest: str) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("hash") == digest and marker.get("format") == FORMAT


def _remove_quietly(path: Path) -> None:
    aside = path.with_name(f".{path.name}-stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _build(out: Path) -> None:
    from transformers.utils import logging as hf_logging

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    model = build_model(tokenizer)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def build_tokenizer():
    """Byte-level BPE trained on CORPUS (deterministic), wrapped for transformers with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL["max_position_embeddings"], clean_up_tokenization_spaces=False)


def build_model(tokenizer):
    """Qwen3-MoE with MODEL's sizes and INIT's weights drawn from a seeded generator, in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig

    vocab = -(-len(tokenizer) // 64) * 64  # round up to a multiple of 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3MoeConfig(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **MODEL)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT["std"])
        model.get_input_embeddings().weight.mul_(INIT["embed_scale"])
        # Sharper logits over tokens that decode to printable text; the rest (special tokens, lone bytes that are
        # not UTF-8 on their own, control characters) get zero logits, so they are almost never sampled: gibberish,
        # but readable gibberish, and replies run to max_new_tokens instead of stopping at a random <|im_end|>.
        head = model.get_output_embeddings().weight  # [vocab, H]
        head.mul_(INIT["head_scale"])
        for i in range(vocab):
            if not _printable(tokenizer, i):
                head[i].zero_()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    return model.eval()


def _printable(tokenizer, token_id: int) -> bool:
    if token_id >= len(tokenizer) or token_id in tokenizer.all_special_ids:
        return False
    text = tokenizer.decode([token_id])
    return bool(text) and "\ufffd" not in text and all(c.isprintable() or c == "\n" for c in text)
