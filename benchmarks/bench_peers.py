"""i3core against TRL's ``GRPOTrainer`` at its fastest, on the same problem, side by side on this machine.

For each scenario and seed, i3core runs first (``i3core run examples/quickstart.toml`` with the scenario's
overrides, SFT warm start included; by default with ``--inference local``, the quickstart's own engine in the
orchestrator's process; ``--inference builtin`` puts it in two server processes with the same slots in all); its
version 0 (the SFT output, an HF directory that transformers loads as ``Qwen3MoeForCausalLM``) is then trained by
TRL 1.16's ``GRPOTrainer`` in a process of its own.

The same objective on both sides: the same prompts in the same order (the orchestrator's stream: the env's
dataset shuffled by ``random.Random(run.seed)``), the same reward (the env's ``score`` of the same text:
i3core's :func:`i3core.text.completion_text` of TRL's ``completion_ids``, not TRL's own ``skip_special_tokens``
text), the same stops (i3core's end ids and the env's stop text, which TRL, stopping on tokens only, gets as its
tokens; set again after TRL builds its generation config, which adds the tokenizer's eos), group size
(``num_generations``), batch (8 prompts x 8), AdamW (same lr, betas, eps,
no weight decay, clipping at 1.0), temperature 1, no KL (``beta = 0``), rewards not divided by their std
(``scale_rewards = "none"``), a token-level loss normaliser (``loss_type = "dapo"``, as i3core's
``num_loss_tokens``), no router auxiliary loss (``router_aux_loss_coef = 0``; i3core trains without one) and
dropout off (TRL's ``disable_dropout``, i3core's ``[trainer] disable_dropout``, its default), and a completion cut
at ``max_tokens`` worth what the env's ``truncated`` says (the quickstart's ``"zero"``: reward 0 on both sides;
``"mask"``: TRL's ``mask_truncated_completions``). Completion lengths are logged per step on both sides
(i3core's ``completion/mean_tokens``, TRL's ``completions/mean_length``, both counting the stop token) and
compared. How they differ by design: i3core is asynchronous (up to ``max_async`` steps off policy, IcePop-masked),
TRL is synchronous and on policy; i3core's trainer computes each prompt once per group (prefix trees), TRL's once
per completion.

TRL at its best: before a scenario's seeds, TRL runs ``trial_steps`` steps on the first seed's SFT weights with
each of its generation paths that run on this CPU (:data:`TRL_GENERATIONS`: ``generate`` with the dynamic or the
static cache, transformers' continuous batching with each of its schedulers) at each of :data:`TRL_THREADS`
torch threads; the fastest (steps/s after the first ``TRIAL_WARMUP`` steps) trains every seed, and all are
reported under ``trl_settings``. vLLM colocated is not among them: TRL imports vLLM in its own process, and the
CPU build of vLLM needs its own torch (``/work/vllm-venv``), which cannot share an environment with the torch
2.13 CPU build TRL and i3core run on. TRL runs without gradient checkpointing (its default recomputes
activations; i3core's trainer keeps them: the faster TRL is the one compared).

Scenarios: ``short`` is the quickstart (completions of a few tokens); ``long_tail`` reverses strings of 8-24
letters with up to 256 new tokens after a 4-step warm start, so completion lengths spread from about 9 tokens to
the 256 cap, a few long rollouts in every batch (the regime asynchrony exists for). i3core runs each with the
settings that measured best for it: both on-policy (``max_sample_lag = 0``: every batch sampled by the weights it
trains, learning as much per step as TRL). ``short`` with the trainer's micro-batches on both cores
(``[trainer] micro_batch_threads = 2``: the engine stands idle while the trainer steps) and 64 engine slots (the
64 rollouts of one batch, all an on-policy run has in flight; the quickstart's 128 serve lag 1), the trainer a
thread of the run's process (``[trainer] colocate``) handing the engine each version in memory (``[weight_sync]
use = "memory"``); ``long_tail`` with
``[trainer] stream_groups``, the batch's finished groups trained while its long rollouts still generate.

Clocks, the same on both sides: warm, from the first rollout request (i3core: the orchestrator's
``time/elapsed_s``, with the trainer started and the engine built; TRL: the first call of its ``_generate``, with
the model loaded and the trainer built) to the end of each step; SFT is i3core's warm start and TRL's input, so
it is on neither clock. Cold (``cold_time_to_reward_ratio``): the same plus each side's start-up
(``startup_s``: process launch to the first rollout request; i3core's without its SFT, whose seconds the trainer
logs). ``cpu_s`` is the CPU time of the whole process tree (``RUSAGE_CHILDREN`` around it), ``peak_rss_mb`` the
peak of the summed RSS of the tree and ``peak_pss_mb`` of its summed PSS (shared pages, torch's libraries above
all, counted once over the processes that map them), sampled every 0.1 s with psutil.

Figures per seed (one :func:`compare`): steps/s after the first ``WARMUP_STEPS``, ``time_to_reward_ratio``
(TRL's seconds to reach ``reward_level`` over i3core's; the level is the SFT level, the mean reward of both sides'
first five steps, plus ``margin``; a moving mean over ``REWARD_WINDOW`` steps), ``steps_to_reward``,
``reward_at_equal_time``, ``completion_tokens``, ``cpu_s``, ``peak_rss_mb``. Per scenario (:func:`over_seeds`,
``--seeds``, 16 by default): ``time_to_reward_ratio`` is the median of the seeds' own ratios and
``time_to_reward_ci95`` its 95 % bootstrap interval (pairs resampled), ``time_to_reward_ratio_of_medians`` TRL's
median seconds over i3core's, ``steps_to_reward_ratio`` the median of the pairs' i3core steps over TRL steps
and ``steps_to_reward_ci95`` its interval, ``steps_per_s_ratio`` and ``peak_rss_ratio`` ratios of the means,
``trl_settings`` the search above.

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
TRIAL_WARMUP = 2
"""Steps of a TRL trial left out of its steps/s (the first generation pays for allocation and set-up)."""
BOOTSTRAP_RESAMPLES = 10_000
"""Resamples of the seeds' pairs behind ``time_to_reward_ci95``."""

SCENARIOS = {
    "short": {
        "steps": 120,
        "trial_steps": 20,
        "margin": 0.08,
        # on-policy; the trainer's micro-batches on both cores while the engine waits for its weights; the engine
        # sized to one batch (docs/benchmarks.md: lag 1 learns less per step, lag 0 measured with each); the trainer
        # a thread of the run's process: one torch runtime, at the process's speed (docs/benchmarks.md, 2026-12-06),
        # handing the engine each version in memory (no files: 2026-12-07)
        "sets": ["scheduler.max_sample_lag=0", "trainer.micro_batch_threads=2", "inference.max_slots=64",
                 "trainer.colocate=true", "weight_sync.use=memory"],
    },
    "long_tail": {
        "steps": 60,
        "trial_steps": 8,
        "margin": 0.05,
        # a short warm start: the model does not stop after every reversal yet, so completions run from about 9
        # tokens to the 256 cap (a few long rollouts in every batch) while RL teaches it to stop
        "sets": ["env.min_len=8", "env.max_len=24", "env.max_tokens=256", "inference.max_len=400",
                 "trainer.seq_len=400", "sft.steps=4",
                 # i3core's settings for the regime (docs/benchmarks.md: lag 1, lag 0, lag 0 streamed, measured):
                 # on-policy batches (learning per step as TRL's), their finished groups trained while the long
                 # ones still generate
                 "scheduler.max_sample_lag=0", "trainer.stream_groups=true"],
    },
}

TRL_GENERATIONS = {
    "generate": {},
    "generate-static-cache": {"cache_implementation": "static"},
    "continuous-batching-fifo": {"use_transformers_continuous_batching": True, "scheduler_type": "fifo"},
    "continuous-batching-prefill-first": {"use_transformers_continuous_batching": True,
                                          "scheduler_type": "prefill_first"},
}
"""TRL's generation paths that run on a CPU: ``model.generate`` on a left-padded batch with the dynamic (default) or
static KV cache, and transformers' continuous-batching engine (paged cache, finished rows replaced at once) with
its two schedulers, its cache sized by :func:`continuous_batching_config`."""
CB_PAGE_TOKENS = 32
"""Tokens per page of the continuous-batching cache (its default, 256, is 10x the quickstart's rollouts)."""
CB_BATCH_TOKENS = 2048
"""Tokens the continuous-batching engine may run in one forward (a batch's 64 prompts prefill in one)."""
TRL_THREADS = (1, 2)
"""torch thread counts TRL is tried with (this machine has 2 cores)."""


# -- measuring a process tree ----------------------------------------------------------


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` to the end; when it was launched (``time.time()``), its wall time, the CPU time of its whole
    tree and the peaks of its summed RSS and PSS."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched_at = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    peak_rss = peak_pss = 0
    done = threading.Event()

    def sample():
        nonlocal peak_rss, peak_pss
        root = psutil.Process(proc.pid)
        while not done.wait(SAMPLE_S):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for p in tree:
                try:
                    info = p.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss, pss = rss + info.rss, pss + info.pss
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)

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
    return {"launched_at": launched_at, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "peak_rss_mb": round(peak_rss / 2**20, 1), "peak_pss_mb": round(peak_pss / 2**20, 1)}


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


def sft_seconds(trainer_log: Path) -> float:
    """The seconds of the trainer's SFT warm start (its last ``sft_s`` log line; 0 without SFT)."""
    seconds = 0.0
    for line in trainer_log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"sft_s"' in line:
            seconds = json.loads(line)["sft_s"]
    return seconds


def run_i3core(config: Path, out: Path, seed: int, steps: int, sets: list[str]) -> dict:
    # weight_sync.keep: version 0 (the SFT output TRL starts from) stays on disk; nothing else changes
    overrides = [f"run.output_dir='{out}'", f"run.seed={seed}", f"run.max_steps={steps}",
                 f"weight_sync.keep={steps + 1}", *sets]
    cmd = [sys.executable, "-m", "i3core.cli", "--log-level", "warning", "run", str(config),
           *(a for s in overrides for a in ("--set", s))]
    result = measure(cmd)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    resolved = json.loads((out / "config.resolved.json").read_text())
    result["times"] = [r["time/elapsed_s"] for r in rows]
    result["rewards"] = [r["reward/mean"] for r in rows]
    result["completion_tokens"] = [r["completion/mean_tokens"] for r in rows]
    # the orchestrator's clock started times[-1] before the last row was written
    first_request_at = metrics.stat().st_mtime - result["times"][-1]
    result["sft_s"] = sft_seconds(out / "logs" / "trainer.log")
    result["startup_s"] = round(first_request_at - result.pop("launched_at") - result["sft_s"], 2)
    result["threads"] = {"trainer": resolved["trainer"]["threads"],
                         "trainer_micro_batches": resolved["trainer"].get("micro_batch_threads", 1),
                         "inference": resolved["inference"].get("threads"),
                         "inference_servers": resolved["inference"].get("servers")}
    result["resolved"] = resolved
    return result


def run_trl(resolved: dict, sft_dir: Path, out: Path, steps: int, setting: dict,
            sampling_seed_offset: int = 0) -> dict:
    """TRL's side in a process of its own with ``setting`` (``generation``: a :data:`TRL_GENERATIONS` key,
    ``threads``); its sampling seed is the run's seed + ``sampling_seed_offset`` (the prompts stay the run's)."""
    spec = out / "trl_spec.json"
    spec.write_text(json.dumps({"resolved": resolved, "sft_dir": str(sft_dir), "steps": steps, "setting": setting,
                                "sampling_seed_offset": sampling_seed_offset, "out": str(out / "trl_result.json")}))
    result = measure([sys.executable, __file__, "--trl-worker", str(spec)])
    worker = json.loads((out / "trl_result.json").read_text())
    if "error" in worker:
        raise SystemExit(f"TRL ({setting['generation']}, {setting['threads']} threads): {worker['error']}")
    worker["startup_s"] = round(worker.pop("first_request_at") - result.pop("launched_at"), 2)
    return {**result, **worker}


def choose_trl(resolved: dict, sft_dir: Path, out: Path, trial_steps: int) -> dict:
    """Every TRL setting (:data:`TRL_GENERATIONS` x :data:`TRL_THREADS`) for ``trial_steps`` steps on the same SFT
    weights; ``chosen`` is the fastest (steps/s after ``TRIAL_WARMUP``), ``tried`` all of them, each with its
    speed or its one-line error."""
    tried = []
    for generation in TRL_GENERATIONS:
        for threads in TRL_THREADS:
            setting = {"generation": generation, "threads": threads}
            try:
                trial = run_trl(resolved, sft_dir, out, trial_steps, setting)
            except SystemExit as exc:  # a path that does not run here is reported, not fatal
                tried.append({**setting, "steps_per_s": None, "error": str(exc)})
                continue
            times = trial["times"]
            speed = (len(times) - TRIAL_WARMUP) / (times[-1] - times[TRIAL_WARMUP - 1])
            tried.append({**setting, "steps_per_s": round(speed, 3),
                          "completion_tokens": round(sum(trial["completion_tokens"]) / len(times), 2)})
            print(json.dumps({"trl_trial": tried[-1]}), file=sys.stderr, flush=True)
    ran = [t for t in tried if t["steps_per_s"] is not None]
    if not ran:
        raise SystemExit("no TRL setting ran: " + "; ".join(t["error"] for t in tried))
    best = max(ran, key=lambda t: t["steps_per_s"])
    return {"chosen": {"generation": best["generation"], "threads": best["threads"]}, "trial_steps": trial_steps,
            "tried": tried}


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


def generation_options(generation: str, rows: int, max_len: int) -> dict:
    """``GRPOConfig`` options of a :data:`TRL_GENERATIONS` path for ``rows`` completions of at most ``max_len``
    tokens (prompt and completion). Continuous batching's cache gets exactly the pages the rows can fill: left to
    itself on a CPU it sized the cache from the machine's memory (12 GB here) and spent most of each step there
    (0.03 steps/s on the quickstart)."""
    options = dict(TRL_GENERATIONS[generation])
    scheduler = options.pop("scheduler_type", None)
    if scheduler is not None:
        pages = rows * -(-max_len // CB_PAGE_TOKENS)
        options["transformers_continuous_batching_config"] = {
            "scheduler_type": scheduler, "page_size": CB_PAGE_TOKENS, "num_blocks": pages,
            "max_batch_tokens": CB_BATCH_TOKENS}
    return options


def trl_worker(spec_path: Path) -> None:
    """TRL's side, in its own process: GRPOTrainer on the SFT weights with the spec's setting, one row per step
    to the result file (or ``{"error": ...}``: a setting that does not run here)."""
    spec = json.loads(spec_path.read_text())
    try:
        result = trl_train(spec)
    except Exception as exc:  # noqa: BLE001 - the trial reports it as one line and the search goes on
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    Path(spec["out"]).write_text(json.dumps(result))


def trl_train(spec: dict) -> dict:
    import itertools

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from i3core.loop.run import stop_strings, stop_token_ids
    from i3core.testing import make_component
    from i3core.text import completion_text

    resolved, steps, setting = spec["resolved"], spec["steps"], spec["setting"]
    torch.set_num_threads(setting["threads"])
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
    i3_tokenizer = i3_model.tokenizer()
    ends, stops = stop_token_ids(i3_model, env), stop_strings(env)
    # where i3core's engine stops: its end ids, and the env's stop text matched as text; TRL stops on tokens: the
    # end ids and the stop text's tokens (one token in tiny-moe's byte tokenizer)
    stop_ids = [*ends, *(i for s in stops for i in tokenizer.encode(s, add_special_tokens=False))]
    model.generation_config.eos_token_id = stop_ids

    truncated = env.config.truncated  # what i3core's env makes of a completion cut at max_tokens

    def reward(prompts, completions, completion_ids, example_id, **_):
        # the text i3core's env scores, made by i3core's one function from the completion's ids (its end id left
        # out, cut before the stop text), not TRL's own skip_special_tokens text; a completion that never
        # stopped (no stop id: TRL cuts its ids after the first) is worth 0 where the env says so
        return [0.0 if truncated == "zero" and (not ids or ids[-1] not in stop_ids) else
                env.score(completion_text(i3_tokenizer, ids, stop_token_ids=ends, stop=stops), by_id[i])
                for ids, i in zip(completion_ids, example_id)]

    times, rewards, lengths = [], [], []
    clock = {"t0": None}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - clock["t0"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                lengths.append(logs["completions/mean_length"])

    max_grad_norm = resolved["trainer"]["max_grad_norm"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=group * prompts_per_step,
            num_generations=group, max_completion_length=env.config.max_tokens, temperature=env.config.temperature,
            learning_rate=opt["lr"], adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1], adam_epsilon=opt["eps"],
            weight_decay=opt["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=max_grad_norm, beta=0.0, scale_rewards="none", loss_type="dapo", num_iterations=1,
            shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            bf16=False, seed=run["seed"] + spec.get("sampling_seed_offset", 0), disable_tqdm=True,
            dataloader_num_workers=0,
            gradient_checkpointing=False,  # TRL's default recomputes activations; i3core keeps them (faster TRL)
            router_aux_loss_coef=0.0,  # i3core trains without the MoE load-balancing loss
            disable_dropout=True,
            mask_truncated_completions=truncated == "mask",  # the env's `truncated = "mask"`, TRL's way
            **generation_options(setting["generation"], group * prompts_per_step, resolved["inference"]["max_len"]),
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        # TRL adds the tokenizer's eos (<|im_end|> in the exported config) to the model's stop ids; i3core's engine
        # stops where stop_token_ids says: so does TRL's generation and its mask after the first stop
        trainer.eos_token_ids = list(stop_ids)
        trainer.generation_config.eos_token_id = list(stop_ids)
        trl_stops = sorted(trainer.generation_config.eos_token_id)
        generate = trainer._generate

        def first_request_clock(*args, **kwargs):  # the clock starts at the first rollout request, as i3core's
            if clock["t0"] is None:
                clock["t0"], clock["at"] = time.perf_counter(), time.time()
            return generate(*args, **kwargs)

        trainer._generate = first_request_clock
        trainer.train()
    same_prompt_ids = tokenizer(examples[0].prompt, add_special_tokens=False)["input_ids"] == \
        i3_tokenizer.encode(examples[0].prompt).ids
    return {"times": times, "rewards": rewards, "completion_tokens": lengths, "first_request_at": clock["at"],
            "threads": {"torch": torch.get_num_threads()}, "setting": setting, "stop_ids": trl_stops,
            "same_prompt_ids": same_prompt_ids}


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


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(i3: dict, trl: dict, margin: float) -> dict:
    start = (mean(i3["rewards"][:REWARD_WINDOW]) + mean(trl["rewards"][:REWARD_WINDOW])) / 2
    level = start + margin
    t_i3, t_trl = time_to(level, i3["times"], i3["rewards"]), time_to(level, trl["times"], trl["rewards"])
    equal = min(i3["times"][-1], trl["times"][-1])
    i3_sps, trl_sps = steps_per_s(i3["times"]), steps_per_s(trl["times"])
    cold_i3 = None if t_i3 is None else i3["startup_s"] + t_i3
    cold_trl = None if t_trl is None else trl["startup_s"] + t_trl
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
        "startup_s": {"i3core": i3["startup_s"], "trl": trl["startup_s"]},
        "sft_s": i3["sft_s"],
        "cold_time_to_reward_s": {"i3core": None if cold_i3 is None else round(cold_i3, 2),
                                  "trl": None if cold_trl is None else round(cold_trl, 2)},
        "cold_time_to_reward_ratio": None if cold_i3 is None or cold_trl is None else round(cold_trl / cold_i3, 3),
        "steps_to_reward": {"i3core": step_to(level, i3["rewards"]), "trl": step_to(level, trl["rewards"])},
        "equal_time_s": round(equal, 2),
        "reward_at_equal_time": {"i3core": round(at_time(equal, i3["times"], i3["rewards"]), 4),
                                 "trl": round(at_time(equal, trl["times"], trl["rewards"]), 4)},
        "reward_last5": {"i3core": round(moving(i3["rewards"])[-1], 4), "trl": round(moving(trl["rewards"])[-1], 4)},
        # tokens per completion, stop token included: the first steps are the same SFT weights on both sides
        "completion_tokens_first5": {"i3core": round(mean(i3["completion_tokens"][:REWARD_WINDOW]), 2),
                                     "trl": round(mean(trl["completion_tokens"][:REWARD_WINDOW]), 2)},
        "completion_tokens_mean": {"i3core": round(mean(i3["completion_tokens"]), 2),
                                   "trl": round(mean(trl["completion_tokens"]), 2)},
        "completion_tokens_per_step": {"i3core": [round(x, 2) for x in i3["completion_tokens"]],
                                       "trl": [round(x, 2) for x in trl["completion_tokens"]]},
        "rewards_per_step": {"i3core": [round(x, 4) for x in i3["rewards"]],
                             "trl": [round(x, 4) for x in trl["rewards"]]},
        "rl_time_s": {"i3core": round(i3["times"][-1], 2), "trl": round(trl["times"][-1], 2)},
        "wall_s": {"i3core": i3["wall_s"], "trl": trl["wall_s"]},
        "cpu_s": {"i3core": i3["cpu_s"], "trl": trl["cpu_s"]},
        "peak_rss_mb": {"i3core": i3["peak_rss_mb"], "trl": trl["peak_rss_mb"]},
        "peak_pss_mb": {"i3core": i3["peak_pss_mb"], "trl": trl["peak_pss_mb"]},
        "threads": {"i3core": i3["threads"], "trl": trl["threads"]},
        "trl_setting": trl["setting"],
        "stop_ids": trl["stop_ids"],
        "same_prompt_ids": trl["same_prompt_ids"],
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def bootstrap_ci95(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """95 % percentile-bootstrap interval of the median of ``values`` (the pairs resampled with replacement)."""
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def finite(value: float | None, digits: int = 3) -> float | None:
    """``value`` rounded, or None for a side that never reached the level (an infinite or undefined ratio)."""
    return None if value is None or value in (float("inf"), float("-inf")) else round(value, digits)


def paired(ours: float | int | None, theirs: float | int | None, ours_over_theirs: bool = False) -> float | None:
    """One pair's ratio (TRL over i3core, or i3core over TRL): a side that never reached the level counts as
    infinitely late (0 or inf); None when neither did."""
    if ours_over_theirs:
        ours, theirs = theirs, ours
    if ours is None:
        return 0.0 if theirs is not None else None
    return float("inf") if theirs is None else theirs / ours


def over_seeds(runs: list[dict]) -> dict:
    """The scenario's figures over its seeds (one :func:`compare` each). Each seed is a pair run on the same SFT
    weights and prompts, and learning per step is noisy (one seed reaches the level in 10 steps, the next in 40,
    on either side), so ``time_to_reward_ratio`` is the median over the seeds of each pair's own ratio (a side
    that never reaches the level: 0 or infinite), with a 95 % bootstrap interval over the pairs;
    ``time_to_reward_ratio_of_medians`` is TRL's median seconds over i3core's, which ignores the pairing;
    ``steps_to_reward_ratio`` the median of the pairs' i3core steps over TRL's (above 1: i3core needed more steps),
    ``steps_to_reward_ci95`` its bootstrap interval.
    Speeds, CPU time and memory are means over the seeds; every seed's own figures are under ``seeds``."""
    ratios = [r for r in (paired(run["i3core_time_to_reward_s"], run["trl_time_to_reward_s"]) for run in runs)
              if r is not None]  # None: neither side reached the level
    cold = [r for r in (paired(run["cold_time_to_reward_s"]["i3core"], run["cold_time_to_reward_s"]["trl"])
                        for run in runs) if r is not None]
    steps = [r for r in (paired(run["steps_to_reward"]["i3core"], run["steps_to_reward"]["trl"], True)
                         for run in runs) if r is not None]

    def reached(side):
        return median([r[f"{side}_time_to_reward_s"] or float("inf") for r in runs])

    def averaged(key):
        return {side: round(mean([r[key][side] for r in runs]), 3) for side in ("i3core", "trl")}

    t_i3, t_trl = reached("i3core"), reached("trl")
    i3_sps, trl_sps = mean([r["i3core_steps_per_s"] for r in runs]), mean([r["trl_steps_per_s"] for r in runs])
    rss = averaged("peak_rss_mb")
    pss = averaged("peak_pss_mb")
    return {
        "seeds": runs,
        "i3core_steps_per_s": round(i3_sps, 3),
        "trl_steps_per_s": round(trl_sps, 3),
        "steps_per_s_ratio": round(i3_sps / trl_sps, 3),
        "time_to_reward_ratio": finite(median(ratios)) if ratios else None,
        "time_to_reward_ci95": [finite(x) for x in bootstrap_ci95(ratios)] if ratios else None,
        "time_to_reward_ratio_per_seed": [r["time_to_reward_ratio"] for r in runs],
        "time_to_reward_ratio_of_medians": finite(t_trl / t_i3) if t_i3 != float("inf") else None,
        "cold_time_to_reward_ratio": finite(median(cold)) if cold else None,
        "cold_time_to_reward_ci95": [finite(x) for x in bootstrap_ci95(cold)] if cold else None,
        "i3core_time_to_reward_s": finite(t_i3, 2),
        "trl_time_to_reward_s": finite(t_trl, 2),
        "steps_to_reward": {side: [r["steps_to_reward"][side] for r in runs] for side in ("i3core", "trl")},
        "steps_to_reward_ratio": finite(median(steps)) if steps else None,
        "steps_to_reward_ci95": [finite(x) for x in bootstrap_ci95(steps)] if steps else None,
        "steps_to_reward_ratio_per_seed": [finite(x) for x in steps],
        "peak_rss_mb": rss,
        "peak_rss_ratio": round(rss["i3core"] / rss["trl"], 3),
        "peak_pss_mb": pss,
        "peak_pss_ratio": round(pss["i3core"] / pss["trl"], 3),
        **{key: averaged(key) for key in ("reward_at_equal_time", "reward_last5", "cpu_s", "startup_s",
                                          "completion_tokens_first5", "completion_tokens_mean")},
        "threads": runs[0]["threads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml", help="i3core run config")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--steps", type=int, default=None, help="RL steps per side (default: the scenario's)")
    parser.add_argument("--seeds", default=",".join(map(str, range(16))),
                        help="comma-separated run.seed values, each run by both sides")
    parser.add_argument("--inference", choices=("local", "builtin"), default="local",
                        help="i3core's engine: in the orchestrator's process (local, the quickstart's) or two servers")
    parser.add_argument("--trl-sampling-seed", type=int, default=0, metavar="OFFSET",
                        help="TRL samples with seed run.seed + OFFSET (same prompts, same weights): TRL's own spread")
    parser.add_argument("--trl", default="search", metavar="GENERATION:THREADS",
                        help="TRL's setting: 'search' (default: every TRL_GENERATIONS path x TRL_THREADS on the "
                             "first seed, the fastest for all) or one, e.g. 'generate:2' ("
                             + ", ".join(TRL_GENERATIONS) + ")")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="extra i3core override section.key=value (both scenarios)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker is not None:
        trl_worker(args.trl_worker)
        return
    fixed = None
    if args.trl != "search":
        generation, _, threads = args.trl.partition(":")
        if generation not in TRL_GENERATIONS or not threads.isdigit():
            parser.error(f"--trl {args.trl!r}: 'search' or GENERATION:THREADS with GENERATION one of "
                         + ", ".join(TRL_GENERATIONS))
        fixed = {"chosen": {"generation": generation, "threads": int(threads)}, "tried": []}
    unknown = [name for name in args.scenarios.split(",") if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"load_avg_start": os.getloadavg()[0], "seeds": seeds, "inference": args.inference,
              "trl_sampling_seed": args.trl_sampling_seed}
    for name in args.scenarios.split(","):
        scenario = SCENARIOS[name]
        steps = args.steps or scenario["steps"]
        runs, settings = [], fixed
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                config = with_inference(args.config, args.inference, out)
                i3 = run_i3core(config, out / "run", seed, steps, [*scenario["sets"], *args.sets])
                sft = out / "sft"
                shutil.copytree(out / "run" / "broadcasts" / "step_0", sft)
                resolved = i3.pop("resolved")
                if settings is None:
                    settings = choose_trl(resolved, sft, out, scenario["trial_steps"])
                trl = run_trl(resolved, sft, out, steps, settings["chosen"], args.trl_sampling_seed)
            runs.append({"seed": seed, **compare(i3, trl, scenario["margin"]), "load_avg": os.getloadavg()[0]})
            print(json.dumps({name: {k: v for k, v in runs[-1].items() if not k.endswith("_per_step")}}),
                  file=sys.stderr, flush=True)
        result[name] = {**over_seeds(runs), "trl_settings": settings}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
