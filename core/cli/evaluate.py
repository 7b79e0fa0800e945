"""``i3core env eval``: run an environment against an inference server and report its rewards.

The smoke test of an env (verifiers' ``vf-eval``): the first ``n`` rows of
the dataset, ``rollouts_per_example`` rollouts each, ``concurrency`` at a
time, through the same client and the same ``env.rollout`` a training run
uses (group-level scoring included), against a running server (``--server``)
or a builtin server started for the occasion on given or freshly initialised
weights. No trainer, no weight updates.
"""

import asyncio
import contextlib
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from i3core.errors import I3Error
from i3core.types import Rollout


@dataclass
class EvalResult:
    rollouts: list[Rollout]
    failed: list[tuple[str, str]]
    """(example id, error) of every rollout that raised or was masked."""
    seconds: float

    def summary(self) -> dict[str, Any]:
        """Reward mean/std/min/max, the mean of every rollout metric, and per task the mean reward."""
        rewards = [r.reward for r in self.rollouts]
        out: dict[str, Any] = {"rollouts": len(self.rollouts), "failed": len(self.failed),
                               "seconds": round(self.seconds, 2)}
        if rewards:
            out.update({"reward/mean": statistics.fmean(rewards), "reward/std": statistics.pstdev(rewards),
                        "reward/min": min(rewards), "reward/max": max(rewards)})
        metrics: dict[str, list[float]] = {}
        for rollout in self.rollouts:
            for key, value in rollout.metrics.items():
                metrics.setdefault(key, []).append(float(value))
            if rollout.example.task:
                metrics.setdefault(f"env/{rollout.example.task}/reward", []).append(rollout.reward)
        out.update({key: statistics.fmean(values) for key, values in sorted(metrics.items())})
        return out


async def evaluate(env, client, *, n: int, rollouts_per_example: int = 1, concurrency: int = 8,
                   seed: int = 0) -> EvalResult:
    """Roll out ``n`` rows ``rollouts_per_example`` times each and score groups as a run does. The rows are
    the first ``n`` of the dataset, or, for an env that orders its own prompts (an env group mixing its
    members), the first ``n`` it draws from a ``seed``-ed stream."""
    stream = getattr(env, "example_stream", None)
    examples = env.examples()[:n] if stream is None else list(itertools.islice(stream(random.Random(seed)), n))
    if not examples:
        raise I3Error("the env's dataset is empty")
    gate = asyncio.Semaphore(concurrency)
    failed: list[tuple[str, str]] = []

    async def one(example) -> Rollout | None:
        async with gate:
            try:
                return await env.rollout(client, example)
            except Exception as exc:  # a masked or failed rollout is reported; the evaluation goes on
                failed.append((example.id, f"{type(exc).__name__}: {exc}"))
                return None

    start = time.perf_counter()
    groups = await asyncio.gather(*(asyncio.gather(*(one(e) for _ in range(rollouts_per_example)))
                                    for e in examples))
    rollouts = []
    score_group = getattr(env, "score_group", None)
    for group in groups:
        done = [r for r in group if r is not None]
        if done and score_group is not None:
            await score_group(done)
        rollouts += done
    return EvalResult(rollouts, failed, time.perf_counter() - start)


@contextlib.contextmanager
def local_server(plugins, model_name: str, model_dir: Path | None, max_len: int, seed: int):
    """A builtin server on ``model_dir`` (default: fresh ``model_name`` weights from ``seed``): (source, url)."""
    from i3core.testing import make_component

    source = make_component("rollout_source", "builtin", plugins=plugins, servers=1, max_len=max_len)
    with tempfile.TemporaryDirectory(prefix="i3core-eval-") as tmp:
        if model_dir is None:
            model = make_component("model", model_name, plugins=plugins)
            model_dir = Path(tmp) / "weights"
            model.save_hf(model.build(seed=seed), model_dir)
        try:
            try:
                url = source.start(model_dir, Path(tmp) / "logs", model={"use": model_name})[0]
            except I3Error as exc:
                log = Path(tmp) / "logs" / "inference-0.log"
                tail = log.read_text()[-1500:] if log.exists() else ""
                raise I3Error(f"{exc}\n{tail}") from None
            yield source, url
        finally:
            source.close()



def build_env(target: str, options: list[str], model_name: str):
    """The env (a registered name with ``key=value`` options, or a plugins.toml's ``[env]``), the model
    component whose tokenizer it is evaluated with, and the env's name."""
    from i3core.config import apply_overrides, load_config, validate_component
    from i3core.errors import ConfigError, Problem
    from i3core.manager import load_plugins
    from i3core.testing import make_component

    overrides = [f"env.{o}" for o in options]
    if target.endswith(".toml"):
        config, plugins = load_config(target, overrides)
        spec = config.get("env")
        if spec is None:
            raise ConfigError([Problem("env", f"{target} has no [env] section")])
        model_spec = config.get("model")
        model = model_spec.build() if model_spec is not None else make_component("model", model_name, plugins=plugins)
        return spec.build(), model, plugins, spec.name
    plugins = load_plugins()
    problems: list[Problem] = []
    values = apply_overrides({"env": {}}, overrides)["env"]
    spec = validate_component("env", {"use": target, **values}, plugins, problems)
    if spec is None:
        raise ConfigError(problems)
    return spec.build(), make_component("model", model_name, plugins=plugins), plugins, target


def run_eval(args) -> tuple[EvalResult, str]:
    """What ``i3core env eval`` does with its parsed arguments: (the result, the env's name)."""
    from i3core.loop.run import stop_strings, stop_token_ids
    from i3core.testing import make_component

    env, model, plugins, name = build_env(args.env, args.options, args.model)
    if getattr(env, "requires_sandbox", False) and args.sandbox is None:
        raise I3Error(f"env {name!r} runs code: pass --sandbox (e.g. --sandbox local)")
    tokenizer = model.tokenizer()
    stop_ids, stop = stop_token_ids(model, env), stop_strings(env)
    sandbox = None if args.sandbox is None else make_component("sandbox", args.sandbox, plugins=plugins)
    with contextlib.ExitStack() as stack:
        if args.server is None:
            server = local_server(plugins, args.model, args.model_dir, args.max_len, args.seed)
            source, url = stack.enter_context(server)
        else:
            source, url = make_component("rollout_source", "builtin", plugins=plugins), args.server
        client = source.client(url, tokenizer, stop_ids, stop)
        result = asyncio.run(_evaluate_with(env, client, sandbox, args))
    return result, name


async def _evaluate_with(env, client, sandbox, args) -> EvalResult:
    pool = None
    try:
        if sandbox is not None:
            from i3core.sandbox.pool import SandboxPool

            bind = getattr(env, "bind_sandboxes", None)
            if bind is None:
                raise I3Error("--sandbox: this env runs no code, it takes no sandbox")
            pool = SandboxPool.for_backend(sandbox)
            await pool.start()
            bind(pool)
        return await evaluate(env, client, n=args.n, rollouts_per_example=args.rollouts_per_example,
                              concurrency=args.concurrency, seed=args.seed)
    finally:
        await client.close()
        if pool is not None:
            await pool.close()
