"""Expert deferral by routing-weight mass against deferral by count, on the demo model (issue 20; runs on a CPU in
about 3 minutes; not library code): HF float32, MoE blocks rewritten in plain torch with the deferral semantics of
ktinject.testing.plain_deferral, the deferral tests' reference, scored one decode step a token
(ktinject.eval.score_decode). Policy 'count d': each token's d lowest-weighted slots (``defer=d``); 'mass m': its
lowest-weighted slots whose cumulative share of the token's routing weight stays <= m, never the top slot
(``defer=m``); both masks by ktinject.testing.deferred_slots, the tests' reference of the native selection. Prints
perplexity and the share of slots deferred, which bounds the speed-up at 1 + share
(ktinject.bench.defer.share_bound).

    python tests/gpu/probe_defer_mass.py [TOKENS]    (default 16384; 1000000: the whole held-out text)
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ktinject.demo import demo_model_dir, heldout_text
from ktinject.eval import windows, score_decode
from ktinject.testing import deferred_slots, plain_deferral

torch.manual_seed(0)
d = demo_model_dir()
tok = AutoTokenizer.from_pretrained(d)
ids = torch.tensor(tok(heldout_text())["input_ids"])[: int(sys.argv[1]) if len(sys.argv) > 1 else 16384]
chunks = windows(ids, 256)
stats = {"def": 0, "all": 0}


def install(model, val):
    def deferred(w):
        m = deferred_slots(w, val)  # an int: count, a float: mass
        stats["def"] += int(m.sum())
        stats["all"] += m.numel()
        return m
    plain_deferral(model, deferred)


base = None
for policy, val in [("count", 0), ("count", 1), ("mass", 0.15), ("mass", 0.2), ("mass", 0.25), ("mass", 0.3), ("count", 2)]:
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    install(model, val)
    stats.update({"def": 0, "all": 0})
    with torch.no_grad():
        s, _ = score_decode(model, chunks)
    ppl = s.perplexity
    base = base or ppl
    share = stats["def"] / max(stats["all"], 1)
    print(f"{policy} {val}: perplexity {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%), slots deferred {100 * share:.1f}%", flush=True)
