"""Full fine-tuning against LoRA (``[model.lora]``, rank 16 on every linear layer) on the same ``hf`` model.

On a Qwen3 of about 100M parameters built from config (examples/make_hf_model.py, random weights), in the same run:

- ``trainer_peak_rss_mb``: the trainer role (``python -m i3core.loop.trainer``, one process) training ``--steps``
  steps on the same prepared batches and publishing a version per step (filesystem sync), its peak RSS;
- ``steps_per_s``: 1 / the median ``step_time_s`` of those steps after the first (train + publish);
- ``publish_bytes_per_version``: the bytes of one published version on disk;
- ``update_pause_ms``: the builtin engine (the one behind the builtin server and ``local``) decoding
  ``--sequences`` sequences while each version is swapped in between two decode steps: the mean time it stands
  still (``Engine.load_state``, what the server's ``update_pause_s`` counts);
- ``reward``: the quickstart's problem on an ``hf`` model (examples/hf_model.toml, its small Qwen3): the SFT warm
  start once, in full; from its output ``--rl-steps`` RL steps in full and with the adapter; the mean reward of
  the last five steps of each.

Each is ``{"full": ..., "lora": ...}``; ``ratios`` are lora / full. ``lora_serving`` compares the two ways an engine
can apply an adapter: low-rank terms in the forward (what the engine does: a swap moves the adapter's tensors
alone) against merging ``W0 + (alpha/r) B A`` into the weights at every update (a swap rewrites every target
matrix, decode runs on plain weights): the swap's cost and a decode step's time for each.
"""

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench_peers import measure
from runs import run_config

ROOT = Path(__file__).resolve().parent.parent
LORA = {"rank": 16, "alpha": 32.0, "target_modules": "all-linear"}
SIZE_100M = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 4, "head_dim": 64}
"""About 101M parameters with the example's 384-token vocabulary."""


def make_hf_model(path: Path, **overrides) -> Path:
    spec = importlib.util.spec_from_file_location("make_hf_model", ROOT / "examples" / "make_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_hf_model(path, "qwen3", **overrides)


def write_batches(out: Path, steps: int, rows: int, seq_len: int, vocab: int) -> None:
    """``steps`` batches of random samples packed into ``rows`` rows of ``seq_len`` tokens."""
    from i3core.loop.packing import Sample, pack

    rng = random.Random(0)
    (out / "batches").mkdir(parents=True)
    for step in range(1, steps + 1):
        samples = []
        for _ in range(rows):
            n_prompt, n_completion = seq_len // 4, seq_len - seq_len // 4
            ids = [rng.randrange(vocab) for _ in range(seq_len)]
            samples.append(Sample(ids, [False] * n_prompt + [True] * n_completion,
                                  [0.0] * n_prompt + [-rng.uniform(0.5, 3.0) for _ in range(n_completion)],
                                  [-1] * n_prompt + [0] * n_completion, rng.uniform(-1, 1)))
        torch.save(pack(samples, seq_len=seq_len), out / "batches" / f"step_{step}.pt")


def train(kind: str, model: dict, work: Path, args) -> dict:
    """The trainer role on prepared batches; its peak RSS, steps/s and the bytes of a version."""
    from i3core.config import validate
    from i3core.manager import load_plugins

    out = work / kind
    write_batches(out, args.steps, args.rows, args.seq_len, vocab=384)
    data = {"run": {"output_dir": str(out), "max_steps": args.steps}, "model": model,
            "env": {"use": "reverse-text"}, "loss": {"use": "pg"}, "optimizer": {"use": "adamw", "lr": 1e-4},
            "weight_sync": {"use": "filesystem", "keep": args.steps + 1},
            "trainer": {"seq_len": args.seq_len, "micro_batch_rows": args.rows, "threads": args.threads}}
    config = work / f"{kind}.json"
    config.write_text(json.dumps(validate(data, load_plugins()).to_dict()))
    tree = measure([sys.executable, "-m", "i3core.loop.trainer", str(config)])
    times = [json.loads((out / "trainer" / f"step_{s}.json").read_text())["step_time_s"]
             for s in range(2, args.steps + 1)]
    version = out / "broadcasts" / f"step_{args.steps}"
    return {"out": out, "peak_rss_mb": tree["peak_rss_mb"], "steps_per_s": 1 / statistics.median(times),
            "bytes": sum(f.stat().st_size for f in version.iterdir() if f.is_file())}


def pauses(component, out: Path, args) -> float:
    """Mean ms the engine stands still per swap, versions 1..steps swapped in while sequences decode."""
    from i3core.plugins.inference.engine import Engine, Request

    engine = Engine(component.load_hf(out / "broadcasts" / "step_0"), max_slots=args.sequences,
                    max_len=args.swap_every * (args.steps + 2) + 16)
    rng = random.Random(1)
    for _ in range(args.sequences):
        engine.add(Request([rng.randrange(384) for _ in range(8)], max_tokens=args.swap_every * (args.steps + 1)))
    took = []
    for version in range(1, args.steps + 1):
        for _ in range(args.swap_every):
            engine.step()
        state = engine.stage(out / "broadcasts" / f"step_{version}")
        start = time.perf_counter()
        engine.load_state(state, version)
        took.append(time.perf_counter() - start)
    return 1000 * statistics.mean(took)


def decoding_engine(model, args):
    """An engine over ``model`` with ``--sequences`` sequences prefilled and room for every timed step."""
    from i3core.plugins.inference.engine import Engine, Request

    engine = Engine(model, max_slots=args.sequences, max_len=args.decode_steps * (args.rounds + 1) + 32)
    rng = random.Random(1)
    for _ in range(args.sequences):
        engine.add(Request([rng.randrange(384) for _ in range(8)], max_tokens=args.decode_steps * (args.rounds + 1)))
    engine.step()  # the prefill
    return engine


def lora_serving(component, work: Path, args) -> dict:
    """The adapter as low-rank terms in the forward (what the engine does) against merged into the weights at
    every swap: the swap's cost (merging: ``W0 + (alpha/r) B A`` into every target matrix) and a decode step's
    time on each, timed in alternating rounds (the machine's load drifts) and the medians taken."""
    from peft.tuners.lora import LoraLayer

    from i3core.config import build_component
    from i3core.manager import load_plugins

    adapter = work / "lora" / "broadcasts" / f"step_{args.steps}"
    unmerged = decoding_engine(component.load_hf(adapter), args)
    merged_dir = component.save_merged(adapter, work / "merged")
    plain = build_component("model", {"use": "hf", "path": str(merged_dir)}, load_plugins())
    merged = decoding_engine(plain.load_hf(merged_dir), args)
    layers = [m for m in unmerged.model.modules() if isinstance(m, LoraLayer)]
    originals = [m.get_base_layer().weight.detach().clone() for m in layers]
    steps = {"low_rank_terms": [], "merged": []}
    merges = []
    for _ in range(args.rounds):
        for name, engine in (("low_rank_terms", unmerged), ("merged", merged)):
            start = time.perf_counter()
            for _ in range(args.decode_steps):
                engine.step()
            steps[name].append(1000 * (time.perf_counter() - start) / args.decode_steps)
        start = time.perf_counter()
        with torch.no_grad():  # what a merging engine does at each update
            for layer, original in zip(layers, originals):
                torch.add(original, layer.get_delta_weight("default"), out=scratch(layer, original))
        merges.append(1000 * (time.perf_counter() - start))
    return {"swap_ms": {"low_rank_terms": None, "merged": round(statistics.median(merges), 2)},
            "decode_step_ms": {k: round(statistics.median(v), 2) for k, v in steps.items()}}


_SCRATCH: dict = {}


def scratch(layer, like: torch.Tensor) -> torch.Tensor:
    """A merged weight's buffer per layer (a merging engine writes into its own copy of the weights)."""
    return _SCRATCH.setdefault(id(layer), torch.empty_like(like))


def sft_base(work: Path, args) -> Path:
    """examples/hf_model.toml's small Qwen3 after its SFT warm start in full (version 0 of a one-step run): the base
    both sides of the reward comparison start RL from, as a user would put an adapter on a model that already
    answers in the task's format (an adapter alone on random weights learns the format too slowly to compare)."""
    directory = make_hf_model(work / "qwen3")
    out = work / "sft-run"
    run_config(ROOT / "examples" / "hf_model.toml", args.seed, f"model.path='{directory}'", "run.max_steps=1",
               "weight_sync.keep=4", out=out)
    return out / "broadcasts" / "step_0"


def reward(lora: bool, base: Path, args) -> float:
    """Mean reward of the last five of ``--rl-steps`` RL steps of examples/hf_model.toml from ``base`` (no more SFT):
    every parameter trained, or a ``[model.lora]`` adapter at ``--lora-lr-scale`` times the learning rate."""
    with tempfile.TemporaryDirectory() as tmp:
        config = (ROOT / "examples" / "hf_model.toml").read_text()
        if lora:
            config += "\n[model.lora]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in LORA.items())
        path = Path(tmp) / "config.toml"
        path.write_text(config)
        sets = [f"model.path='{base}'", f"run.max_steps={args.rl_steps}", "sft.steps=0"]
        if lora:
            sets.append(f"optimizer.lr={5e-4 * args.lora_lr_scale}")
        _, rows = run_config(path, args.seed, *sets)
    return statistics.mean(r["reward/mean"] for r in rows[-5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="trainer steps (and versions swapped) per side")
    parser.add_argument("--rows", type=int, default=4, help="packed rows per batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    parser.add_argument("--sequences", type=int, default=8, help="sequences the engine decodes while swapping")
    parser.add_argument("--swap-every", type=int, default=4, help="decode steps between two swaps")
    parser.add_argument("--decode-steps", type=int, default=5, help="decode steps timed per serving mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the serving comparison")
    parser.add_argument("--rl-steps", type=int, default=60, help="RL steps of the reward comparison (0: skip it)")
    parser.add_argument("--lora-lr-scale", type=float, default=5.0,
                        help="LoRA's RL learning rate as a multiple of full fine-tuning's")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of the reward comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from i3core.config import build_component
    from i3core.manager import load_plugins

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = make_hf_model(work / "base", **SIZE_100M)
        params = sum(t.numel() for t in load_file(str(base / "model.safetensors")).values())
        sides = {"full": {"use": "hf", "path": str(base)}, "lora": {"use": "hf", "path": str(base), "lora": LORA}}
        for kind, model in sides.items():
            trained = train(kind, model, work, args)
            component = build_component("model", model, load_plugins())
            results[kind] = {**trained, "pause_ms": pauses(component, trained["out"], args), "component": component}
        serving = lora_serving(results["lora"]["component"], work, args)
        serving["swap_ms"]["low_rank_terms"] = round(results["lora"]["pause_ms"], 3)
    keys = {"trainer_peak_rss_mb": "peak_rss_mb", "publish_bytes_per_version": "bytes",
            "update_pause_ms": "pause_ms", "steps_per_s": "steps_per_s"}
    report = {name: {kind: round(results[kind][key], 4) for kind in ("full", "lora")} for name, key in keys.items()}
    ratios = {name: round(v["lora"] / v["full"], 4) for name, v in report.items()}
    if args.rl_steps:
        with tempfile.TemporaryDirectory() as tmp:
            base = sft_base(Path(tmp), args)
            report["reward"] = {"full": round(reward(False, base, args), 4), "lora": round(reward(True, base, args), 4),
                                "rl_steps": args.rl_steps, "lora_lr_scale": args.lora_lr_scale}
    goals = {"trainer_peak_rss_mb": ratios["trainer_peak_rss_mb"] <= 0.5,
             "publish_bytes_per_version": ratios["publish_bytes_per_version"] <= 0.02,
             "update_pause_ms": ratios["update_pause_ms"] <= 0.2, "steps_per_s": ratios["steps_per_s"] >= 1.2}
    print(json.dumps({**report, "ratios": ratios, "goals_met": goals, "lora_serving": serving,
                      "model_params": params, "lora": LORA, "steps": args.steps, "rows": args.rows,
                      "seq_len": args.seq_len}))


if __name__ == "__main__":
    main()
