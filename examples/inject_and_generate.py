"""Load a Hugging Face MoE model, show where ktinject will put each part, inject, and generate.

    python examples/inject_and_generate.py                 # the demo model, dense part on "cuda" if available
    python examples/inject_and_generate.py --gpu cpu       # everything on the CPU (no GPU needed)
    python examples/inject_and_generate.py --model DIR     # your own checkpoint (Qwen3-MoE, DeepSeek, Mixtral, ...)

The demo model is a small trained Qwen3-MoE that ships with the package (4 layers, 16 experts top-4, trained on
Debian's fortunes: it answers in fortune-like English); every step below is the one a real checkpoint goes through.
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import ktinject
from ktinject.demo import demo_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--gpu", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device for attention, norms, routers and shared experts (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    model_dir = args.model or demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

    # 1. The plan: which rule matched which module, which operator replaces it, on which device, how many bytes.
    #    Nothing is moved yet. rules=None picks the packaged rule file for config.model_type.
    print(ktinject.plan(model, gpu=args.gpu))

    # 2. Apply it: routed experts go to the CPU kernels, the rest to args.gpu.
    ktinject.inject(model, gpu=args.gpu)

    # 3. Generate exactly as with any Hugging Face model.
    messages = [{"role": "user", "content": "Tell me a story about a small robot."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(args.gpu)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(f"\n--- reply (up to {args.max_new_tokens} tokens) ---")
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer)


if __name__ == "__main__":
    main()
