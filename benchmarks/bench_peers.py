"""i3core against TRL's ``GRPOTrainer`` on the same problem, side by side on this machine.

For each scenario, i3core runs first (``i3core run examples/quickstart.toml`` with the
scenario's overrides, SFT warm start included; by default with ``--inference local``, the
quickstart's own engine in the orchestrator's process; ``--inference builtin`` puts it in two server
processes with the same slots in all); its version 0 (the SFT output, an HF
directory that transformers loads as ``Qwen3MoeForCausalLM``) is then trained by TRL 1.16's
``GRPOTrainer`` in a process of its own. Both get the same prompts in the same order (the
orchestrator's stream: the env's dataset shuffled by ``random.Random(run.seed)``), the same
reward function (the env's ``score``), the same stop (the env's stop text or end of
sequence), group size (``num_generations``), batch (8 prompts x 8), AdamW (same lr, betas,
eps, no weight decay, clipping at 1.0), temperature 1, no KL (``beta = 0``), rewards not
divided by their std (``scale_rewards = "none"``) and a token-level loss normaliser
(``loss_type = "dapo"``, as i3core's ``num_loss_tokens``). Each keeps its own default thread
counts (reported); TRL runs without gradient checkpointing (its default recomputes activations,
i3core's trainer keeps them: the faster TRL is the one compared). How they differ by design: i3core is asynchronous (up to ``max_async``
steps off policy, IcePop-masked), TRL is synchronous and on policy; i3core's trainer computes each prompt once
per group (prefix trees, ``[trainer] share_prompts``), TRL's once per completion.

Scenarios: ``short`` is the quickstart (completions of a few tokens); ``long_tail`` reverses
strings of 8-24 letters with up to 256 new tokens after a 4-step warm start, so completion
lengths spread from about 9 tokens to the 256 cap, a few long rollouts in every batch (the
regime asynchrony exists for).

Clocks: each side's RL phase, from its first rollout request (i3core: the orchestrator's
``time/elapsed_s``; TRL: ``on_train_begin``) to the end of each step. Start-up (imports,
SFT, server start) is outside the comparison and reported as ``wall_s``. ``cpu_s`` is the
CPU time of the whole process tree (``RUSAGE_CHILDREN`` around it), ``peak_rss_mb`` the peak
of the summed RSS of the tree (sampled every 0.1 s with psutil).

Figures per scenario: ``i3core_steps_per_s`` / ``trl_steps_per_s`` (steps after the first
``WARMUP_STEPS``), ``steps_per_s_ratio`` (i3core over TRL), ``time_to_reward_ratio`` (TRL's
seconds to reach ``reward_level`` over i3core's; the level is the SFT level, the mean
reward of both sides' first five steps, plus ``margin``; a moving mean over
``REWARD_WINDOW`` steps), ``reward_at_equal_time`` (each side's moving mean at the time
the faster-finishing side ended), ``cpu_s``, ``peak_rss_mb``, ``threads``. Each scenario runs once per
``--seeds`` value (both sides, the same seed: same SFT weights, prompts and order); ``time_to_reward_ratio`` is
the median of the seeds' own ratios, the rest means over the seeds (see :func:`over_seeds`); each seed's own
figures are kept under ``seeds``.

The last line is JSON. TRL must be installed: ``pip install -c constraints.txt '.[bench]'``
(see docs/benchmarks.md: pin torch and transformers to the installed versions).
"""

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 5
"""Steps left out of the steps/s figures (first batches, allocator warm-up)."""
REWARD_WINDOW = 5
"""Steps in the moving mean the reward level is judged on."""
SAMPLE_S = 0.1
"""How often the process tree's RSS is sampled."""

SCENARIOS = {
    "short": {
        "steps": 120,
        "margin": 0.08,
        "sets": [],
    },
    "long_tail": {
        "steps": 60,
        "margin": 0.05,
        # a short warm start: the model does not stop after every reversal yet, so completions run from about 9
        # tokens to the 256 cap (a few long rollouts in every batch) while RL teaches it to stop
        "sets": ["env.min_len=8", "env.max_len=24", "env.max_tokens=256", "inference.max_len=400",
                 "trainer.seq_len=400", "sft.steps=4"],
    },
}


# -- measuring a process tree ----------------------------------------------------------


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` to the end; its wall time, the CPU time of its whole tree and the peak of its summed RSS."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.wait(SAMPLE_S):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in tree:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            peak = max(peak, total)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = proc.wait()
    done.set()
    sampler.join()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... exited with {code}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(peak / 2**20, 1)}


# -- the two sides ----------------------------------------------------------------------


INFERENCE = {"local": 'use = "local"\nmax_slots = {slots}\nmax_len = {max_len}\n',
             "builtin": 'use = "builtin"\nservers = 2\nmax_slots = {half}\nmax_len = {max_len}\n'}
"""The ``[inference]`` sections of ``--inference``: the engine in the orchestrator's process (the quickstart's),
or two builtin server processes with as many slots together."""


def with_inference(config: Path, inference: str, out: Path) -> Path:
    """``config`` as it is if its ``[inference]`` is ``inference`` already, else a copy of it whose ``[inference]``
    section is :data:`INFERENCE`'s (same ``max_len`` and slots in all); everything else is the config's."""
    import tomllib

    text = config.read_text()
    section = tomllib.loads(text)["inference"]
    if section["use"] == inference:
        return config
    slots = section.get("max_slots", 64) * section.get("servers", 1)
    start = text.index("[inference]")
    end = text.find("\n[", start + 1)
    body = "[inference]\n" + INFERENCE[inference].format(slots=slots, half=max(slots // 2, 1),
                                                         max_len=section.get("max_len", 256))
    variant = out / config.name
    variant.write_text(text[:start] + body + (text[end:] if end >= 0 else ""))
    return variant


def run_i3core(config: Path, out: Path, seed: int, steps: int, sets: list[str]) -> dict:
    # weight_sync.keep: version 0 (the SFT output TRL starts from) stays on disk; nothing else changes
    overrides = [f"run.output_dir='{out}'", f"run.seed={seed}", f"run.max_steps={steps}",
                 f"weight_sync.keep={steps + 1}", *sets]
    cmd = [sys.executable, "-m", "i3core.cli", "--log-level", "warning", "run", str(config),
           *(a for s in overrides for a in ("--set", s))]
    result = measure(cmd)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resolved = json.loads((out / "config.resolved.json").read_text())
    result["times"] = [r["time/elapsed_s"] for r in rows]
    result["rewards"] = [r["reward/mean"] for r in rows]
    result["threads"] = {"trainer": resolved["trainer"]["threads"],
                         "inference": resolved["inference"].get("threads"),
                         "inference_servers": resolved["inference"].get("servers")}
    result["resolved"] = resolved
    return result


def run_trl(resolved: dict, sft_dir: Path, out: Path, steps: int) -> dict:
    spec = out / "trl_spec.json"
    spec.write_text(json.dumps({"resolved": resolved, "sft_dir": str(sft_dir), "steps": steps,
                                "out": str(out / "trl_result.json")}))
    result = measure([sys.executable, __file__, "--trl-worker", str(spec)])
    worker = json.loads((out / "trl_result.json").read_text())
    return {**result, **worker}


def prompt_stream(env, seed: int):
    """The examples in the order i3core's orchestrator draws them (its ``_examples_in_order``)."""
    rng = random.Random(seed)
    stream = getattr(env, "example_stream", None)
    if stream is not None:
        yield from stream(rng)
        return
    examples = list(env.examples())
    while True:
        rng.shuffle(examples)
        yield from examples


def trl_worker(spec_path: Path) -> None:
    """TRL's side, in its own process: GRPOTrainer on the SFT weights, one row per step to the result file."""
    import itertools

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from i3core.loop.run import stop_token_ids
    from i3core.testing import make_component

    spec = json.loads(spec_path.read_text())
    resolved, steps = spec["resolved"], spec["steps"]
    env_options = {k: v for k, v in resolved["env"].items() if k != "use"}
    env = make_component("env", resolved["env"]["use"], **env_options)
    sched, opt, run = resolved["scheduler"], resolved["optimizer"], resolved["run"]
    group, prompts_per_step = sched["group_size"], sched["batch_size"] // sched["group_size"]
    examples = list(itertools.islice(prompt_stream(env, run["seed"]), steps * prompts_per_step))
    by_id = {e.id: e for e in examples}
    dataset = Dataset.from_list([{"prompt": e.prompt, "example_id": e.id} for e in examples])

    tokenizer = AutoTokenizer.from_pretrained(spec["sft_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["sft_dir"], dtype=torch.float32)
    i3_model = make_component("model", resolved["model"]["use"],
                              **{k: v for k, v in resolved["model"].items() if k != "use"})
    # where i3core's servers stop: its end ids, and the env's stop text (TRL stops on tokens: the text's, one
    # token in tiny-moe's byte tokenizer)
    model.generation_config.eos_token_id = [*stop_token_ids(i3_model, env),
                                            *tokenizer.encode(env.stop_text, add_special_tokens=False)]

    def reward(prompts, completions, example_id, **_):
        return [env.score(c, by_id[i]) for c, i in zip(completions, example_id)]

    times, rewards = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    max_grad_norm = resolved["trainer"]["max_grad_norm"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=group * prompts_per_step,
            num_generations=group, max_completion_length=env.config.max_tokens, temperature=env.config.temperature,
            learning_rate=opt["lr"], adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1], adam_epsilon=opt["eps"],
            weight_decay=opt["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=max_grad_norm, beta=0.0, scale_rewards="none", loss_type="dapo", num_iterations=1,
            shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            bf16=False, seed=run["seed"], disable_tqdm=True, dataloader_num_workers=0,
            gradient_checkpointing=False,  # TRL's default recomputes activations; i3core keeps them (faster TRL)
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        trainer.train()
    same_prompt_ids = tokenizer(examples[0].prompt, add_special_tokens=False)["input_ids"] == \
        i3_model.tokenizer().encode(examples[0].prompt).ids
    Path(spec["out"]).write_text(json.dumps({"times": times, "rewards": rewards,
                                             "threads": {"torch": torch.get_num_threads()},
                                             "same_prompt_ids": same_prompt_ids}))


# -- figures ---------------------------------------------------------------------------


def moving(values: list[float], window: int = REWARD_WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def steps_per_s(times: list[float]) -> float:
    return (len(times) - WARMUP_STEPS) / (times[-1] - times[WARMUP_STEPS - 1])


def step_to(level: float, rewards: list[float]) -> int | None:
    """The first step (1-based) whose moving mean of the reward reaches ``level`` (None: never)."""
    for step, r in enumerate(moving(rewards), start=1):
        if r >= level:
            return step
    return None


def time_to(level: float, times: list[float], rewards: list[float]) -> float | None:
    """When the moving mean of the reward first reaches ``level`` (None: never)."""
    step = step_to(level, rewards)
    return None if step is None else times[step - 1]


def at_time(t: float, times: list[float], rewards: list[float]) -> float:
    """The moving mean of the reward at the last step ended by ``t``."""
    smoothed = moving(rewards)
    done = [r for s, r in zip(times, smoothed) if s <= t]
    return done[-1] if done else smoothed[0]


def compare(i3: dict, trl: dict, margin: float) -> dict:
    start = (sum(i3["rewards"][:REWARD_WINDOW]) / REWARD_WINDOW + sum(trl["rewards"][:REWARD_WINDOW]) / REWARD_WINDOW) / 2
    level = start + margin
    t_i3, t_trl = time_to(level, i3["times"], i3["rewards"]), time_to(level, trl["times"], trl["rewards"])
    equal = min(i3["times"][-1], trl["times"][-1])
    i3_sps, trl_sps = steps_per_s(i3["times"]), steps_per_s(trl["times"])
    return {
        "steps": len(i3["times"]),
        "i3core_steps_per_s": round(i3_sps, 3),
        "trl_steps_per_s": round(trl_sps, 3),
        "steps_per_s_ratio": round(i3_sps / trl_sps, 3),
        "sft_level": round(start, 4),
        "reward_level": round(level, 4),
        "i3core_time_to_reward_s": None if t_i3 is None else round(t_i3, 2),
        "trl_time_to_reward_s": None if t_trl is None else round(t_trl, 2),
        "time_to_reward_ratio": None if t_i3 is None or t_trl is None else round(t_trl / t_i3, 3),
        "steps_to_reward": {"i3core": step_to(level, i3["rewards"]), "trl": step_to(level, trl["rewards"])},
        "equal_time_s": round(equal, 2),
        "reward_at_equal_time": {"i3core": round(at_time(equal, i3["times"], i3["rewards"]), 4),
                                 "trl": round(at_time(equal, trl["times"], trl["rewards"]), 4)},
        "reward_last5": {"i3core": round(moving(i3["rewards"])[-1], 4), "trl": round(moving(trl["rewards"])[-1], 4)},
        "rl_time_s": {"i3core": round(i3["times"][-1], 2), "trl": round(trl["times"][-1], 2)},
        "wall_s": {"i3core": i3["wall_s"], "trl": trl["wall_s"]},
        "cpu_s": {"i3core": i3["cpu_s"], "trl": trl["cpu_s"]},
        "peak_rss_mb": {"i3core": i3["peak_rss_mb"], "trl": trl["peak_rss_mb"]},
        "threads": {"i3core": i3["threads"], "trl": trl["threads"]},
        "same_prompt_ids": trl["same_prompt_ids"],
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def over_seeds(runs: list[dict]) -> dict:
    """The scenario's figures over its seeds (one :func:`compare` each). Each seed is a pair run on the same SFT
    weights and prompts, and learning per step is noisy (one seed reaches the level in 10 steps, the next in 40,
    on either side), so ``time_to_reward_ratio`` is the median over the seeds of each pair's own ratio (a side
    that never reaches the level: 0 or infinite); ``time_to_reward_ratio_of_medians`` is TRL's median seconds
    over i3core's, which ignores the pairing. Speeds, CPU time and memory are means over the seeds; every seed's
    own figures are under ``seeds``."""
    def mean(values):
        return round(sum(values) / len(values), 3)

    def paired(run):
        t_i3, t_trl = run["i3core_time_to_reward_s"], run["trl_time_to_reward_s"]
        if t_i3 is None:
            return 0.0 if t_trl is not None else None
        return float("inf") if t_trl is None else t_trl / t_i3

    def reached(side):
        return median([r[f"{side}_time_to_reward_s"] or float("inf") for r in runs])

    ratios = [r for r in map(paired, runs) if r is not None]  # None: neither side reached the level
    ratio = median(ratios) if ratios else float("inf")
    t_i3, t_trl = reached("i3core"), reached("trl")
    i3_sps, trl_sps = mean([r["i3core_steps_per_s"] for r in runs]), mean([r["trl_steps_per_s"] for r in runs])
    finite = t_i3 != float("inf") and t_trl != float("inf")
    return {
        "seeds": runs,
        "i3core_steps_per_s": i3_sps,
        "trl_steps_per_s": trl_sps,
        "steps_per_s_ratio": round(i3_sps / trl_sps, 3),
        "time_to_reward_ratio": None if ratio == float("inf") else round(ratio, 3),
        "time_to_reward_ratio_per_seed": [r["time_to_reward_ratio"] for r in runs],
        "time_to_reward_ratio_of_medians": round(t_trl / t_i3, 3) if finite else None,
        "i3core_time_to_reward_s": None if t_i3 == float("inf") else round(t_i3, 2),
        "trl_time_to_reward_s": None if t_trl == float("inf") else round(t_trl, 2),
        "steps_to_reward": {side: [r["steps_to_reward"][side] for r in runs] for side in ("i3core", "trl")},
        **{key: {side: mean([r[key][side] for r in runs]) for side in ("i3core", "trl")}
           for key in ("reward_at_equal_time", "reward_last5", "cpu_s", "peak_rss_mb")},
        "threads": runs[0]["threads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml", help="i3core run config")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--steps", type=int, default=None, help="RL steps per side (default: the scenario's)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run.seed values, each run by both sides")
    parser.add_argument("--inference", choices=("local", "builtin"), default="local",
                        help="i3core's engine: in the orchestrator's process (local, the quickstart's) or two servers")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="extra i3core override section.key=value (both scenarios)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker is not None:
        trl_worker(args.trl_worker)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"load_avg_start": os.getloadavg()[0], "seeds": seeds, "inference": args.inference}
    for name in args.scenarios.split(","):
        scenario = SCENARIOS[name]
        steps = args.steps or scenario["steps"]
        runs = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                config = with_inference(args.config, args.inference, out)
                i3 = run_i3core(config, out / "run", seed, steps, [*scenario["sets"], *args.sets])
                sft = out / "sft"
                shutil.copytree(out / "run" / "broadcasts" / "step_0", sft)
                trl = run_trl(i3.pop("resolved"), sft, out, steps)
            runs.append({"seed": seed, **compare(i3, trl, scenario["margin"]), "load_avg": os.getloadavg()[0]})
            print(json.dumps({name: runs[-1]}), file=sys.stderr, flush=True)
        result[name] = over_seeds(runs)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
