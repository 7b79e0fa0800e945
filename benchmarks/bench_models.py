"""``hf`` (transformers' Qwen3-MoE) vs ``tiny-moe`` (grouped-MM experts) on the same weights: trainer step and
builtin-engine decode throughput.

tiny-moe builds a Qwen3-MoE from its Config (``--set`` its fields), writes it with its ``save_hf``, and ``hf``
loads that directory with ``AutoModelForCausalLM``: same config, same weights (their outputs are checked to
agree). Then, in one process:

- train: tokens/s of one trainer step (the trainer's chunked ``token_logprobs``, a policy-gradient loss,
  backward, AdamW) on the same packed batch of ``--rows`` x ``--seq-len`` tokens (samples of 16-48 tokens),
  median over ``--iters`` timed steps after ``--warmup``, the two models alternating;
- decode: generated tokens/s of the builtin :class:`~i3core.plugins.inference.engine.Engine` on
  ``--sequences`` concurrent sequences of ``--decode-tokens`` tokens each (prompts of ``--prompt-len``
  tokens, sampled at temperature 1, no stop tokens), prefill included, one run per model.

The last line is JSON: ``hf_over_tiny_train`` and ``hf_over_tiny_decode`` (hf's tokens/s over tiny-moe's; above
1: hf is faster), the raw tokens/s of each, and the settings.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from i3core.loop.packing import Sample, pack
from i3core.loop.trainer import token_logprobs
from i3core.plugins.inference.engine import Engine, Request
from i3core.testing import make_component, plugin_manager

LOGPROB_CHUNK = 1024
"""The trainer's default ``logprob_chunk``."""


def batch(rows: int, seq_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    samples = []
    while sum(len(s.token_ids) for s in samples) < rows * seq_len * 0.9:
        n = rng.randint(16, 48)
        samples.append(Sample([rng.randrange(vocab) for _ in range(n)], [False] * 4 + [True] * (n - 4),
                              [0.0] * n, [0] * n, rng.uniform(-1, 1)))
    packed = pack(samples, seq_len)
    return packed.input_ids[:rows], packed.position_ids[:rows], packed.loss_mask[:rows], packed.advantages[:rows]


def train_step(model, optimizer, ids, positions, mask, advantages) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    lp = token_logprobs(model, ids, positions, LOGPROB_CHUNK)
    (-(lp * mask * advantages).sum() / mask.sum()).backward()
    optimizer.step()
    return time.perf_counter() - start


def decode(model, sequences: int, prompt_len: int, tokens: int, vocab: int, seed: int) -> float:
    """Generated tokens per second of the engine over ``model``."""
    engine = Engine(model, max_slots=sequences, max_len=prompt_len + tokens + 1)
    rng = random.Random(seed)
    for i in range(sequences):
        engine.add(Request([rng.randrange(vocab) for _ in range(prompt_len)], max_tokens=tokens, seed=seed + i))
    start = time.perf_counter()
    generated = 0
    while engine.has_work():
        generated += sum(len(seq.token_ids) for seq in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="packed rows of a training batch")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a packed row")
    parser.add_argument("--iters", type=int, default=5, help="timed trainer steps per model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trainer steps per model")
    parser.add_argument("--sequences", type=int, default=32, help="concurrent sequences decoded")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of each decoded sequence")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, batch and sampling")
    parser.add_argument("--set", dest="options", action="append", default=[], metavar="FIELD=VALUE",
                        help="a tiny-moe Config field of the shared model (JSON value), e.g. num_experts=16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plugins = plugin_manager(installed=False)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.options)}

    tiny_component = make_component("model", "tiny-moe", plugins=plugins, **options)
    tiny = tiny_component.build(seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        directory = tiny_component.save_hf(tiny, Path(tmp) / "qwen3-moe")
        hf_component = make_component("model", "hf", plugins=plugins, path=str(directory))
        models = {"tiny": tiny, "hf": hf_component.build()}
    vocab = tiny.vocab_size
    ids, positions, mask, advantages = batch(args.rows, args.seq_len, vocab, args.seed)
    with torch.no_grad():
        agree = (models["hf"](ids, positions) - tiny(ids, positions)).abs().max().item()

    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    times = {name: [] for name in models}
    for i in range(args.warmup + args.iters):
        for name, model in models.items():  # alternating: drift on a busy machine hits both alike
            elapsed = train_step(model.train(), optimizers[name], ids, positions, mask, advantages)
            if i >= args.warmup:
                times[name].append(elapsed)
    tokens = args.rows * args.seq_len
    train = {name: tokens / sorted(t)[len(t) // 2] for name, t in times.items()}
    with torch.no_grad():
        dec = {name: decode(m.eval(), args.sequences, args.prompt_len, args.decode_tokens, vocab, args.seed)
               for name, m in models.items()}
    result = {
        "hf_over_tiny_train": round(train["hf"] / train["tiny"], 3),
        "hf_over_tiny_decode": round(dec["hf"] / dec["tiny"], 3),
        "hf_train_tokens_per_s": round(train["hf"], 1),
        "tiny_train_tokens_per_s": round(train["tiny"], 1),
        "hf_decode_tokens_per_s": round(dec["hf"], 1),
        "tiny_decode_tokens_per_s": round(dec["tiny"], 1),
        "outputs_max_abs_diff": agree,
        "rows": args.rows, "seq_len": args.seq_len, "sequences": args.sequences,
        "decode_tokens": args.decode_tokens, "threads": args.threads, "model": options,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
