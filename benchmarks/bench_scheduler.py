"""The schedulers at cluster scale on one machine: sync vs async, slot utilisation, scaling, staleness.

Part 1 runs the real orchestrator against ``simulated`` inference servers
(real processes on 127.0.0.1; decode time, prefill and a long-tail length
distribution modelled as documented in ``i3core.plugins.inference.simulated``)
and a modelled trainer: it waits for each batch file, takes ``--train-s``
seconds (a data-parallel trainer grown with the batch, so its step time stays
the same at every server count) and publishes a version through the
filesystem weight sync, which the servers load in flight. Every server has
``--slots`` slots; per server, a step trains ``--slots`` rollouts. ``sync``
generates a whole batch on the weights it trains; ``async`` keeps every slot
busy (``inflight`` = servers x slots).

Part 2 runs ``examples/quickstart.toml`` (real trainer, its in-process engine) with
each scheduler for ``--quickstart-steps`` steps and compares their step times.

Figures are taken between the end of step ``--warm`` and the last step. The
last line is JSON: ``sync_over_async_step_time``, ``async_utilization``,
``sync_utilization``, ``scaling_efficiency`` (server count -> throughput /
(count x one server's throughput), throughput = trained completion tokens per
second), ``off_policy_steps_hist`` (off-policy steps -> fraction of the trained
tokens of the one-server async run), ``quickstart_sync_over_async_step_time``
and the raw figures of every scenario under ``runs``.
"""

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUP_SIZE = 8
LENGTHS = {"length_min": 50, "length_median": 150.0, "length_max": 600, "length_sigma": 0.9}
"""Completion lengths: INTELLECT-3's 5k-60k tokens scaled down by 100."""


class WindowSink:
    """A metric sink that stamps every step and snapshots the servers' counters at two steps."""

    def __init__(self, urls: list[str], snapshot_at: tuple[int, int]):
        self.urls, self.snapshot_at = urls, snapshot_at
        self.rows: dict[int, dict] = {}
        self.times: dict[int, float] = {}
        self.servers: dict[int, list[dict]] = {}

    def open(self, output_dir: Path) -> None:
        pass

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.times[step] = time.perf_counter()
        self.rows[step] = metrics
        if step in self.snapshot_at:
            self.servers[step] = [json.loads(urllib.request.urlopen(u + "/i3/metrics", timeout=10).read()) for u in self.urls]

    def close(self) -> None:
        pass


async def modelled_trainer(paths, sync, steps: int, train_s: float, template: Path) -> None:
    """Wait for each batch, take ``train_s``, write the step's metrics and publish the next version."""
    from i3core.files import atomic_write_bytes

    for step in range(1, steps + 1):
        while not paths.batch(step).exists():
            await asyncio.sleep(0.01)
        await asyncio.sleep(train_s)
        paths.batch(step).unlink()
        atomic_write_bytes(paths.trainer_metrics(step), json.dumps({"loss": 0.0}).encode())
        sync.write(paths.broadcasts, step, lambda d: shutil.copytree(template, d))


def simulated_run(scheduler: dict, servers: int, args, work: Path) -> dict:
    """One scenario: the orchestrator, ``servers`` simulated servers and the modelled trainer."""
    from i3core.config import validate
    from i3core.manager import load_plugins
    from i3core.loop.orchestrator import ClientSlot, Orchestrator
    from i3core.config import with_defaults
    from i3core.loop.run import build, stop_strings, stop_token_ids
    from i3core.loop.paths import RunPaths

    out = work / f"{scheduler['use']}-{servers}"
    timing = {"step_base_ms": args.step_base_ms, "step_per_seq_ms": args.step_per_seq_ms, **LENGTHS}
    data = {
        "run": {"output_dir": str(out), "max_steps": args.steps, "seed": 0},
        "model": {"use": "tiny-moe"},
        "inference": {"use": "simulated", "servers": servers, "max_slots": args.slots, "max_len": 1024,
                      "timing": timing},
        "env": {"use": "reverse-text", "num_examples": 2000, "max_tokens": LENGTHS["length_max"]},
        "trainer": {"seq_len": 1024},
        "scheduler": scheduler,
    }  # fmt: skip
    plugins = load_plugins()
    config = with_defaults(validate(data, plugins), plugins)
    run = build(config, plugins)
    paths = RunPaths(out)
    paths.make()
    model, sync, source = run.components["model"], run.components["weight_sync"], run.components["inference"]
    template = work / "weights"
    if not template.exists():
        model.save_hf(model.build(), template)
    sync.write(paths.broadcasts, 0, lambda d: shutil.copytree(template, d))
    tokenizer, env = model.tokenizer(), run.components["env"]
    stop_ids, stop = stop_token_ids(model, env), stop_strings(env)
    try:
        urls = source.start(sync.location(paths.broadcasts, 0), out / "logs")
        sink = WindowSink(urls, (args.warm, args.steps))
        clients = [ClientSlot(source.client(url, tokenizer, stop_ids, stop), url) for url in urls]
        orchestrator = Orchestrator(config, plugins, env, run.components["scheduler"], sync, clients,
                                    [run.components["metrics"], sink])  # fmt: skip

        async def both():
            try:
                await asyncio.gather(orchestrator.run(), modelled_trainer(paths, sync, args.steps, args.train_s, template))
            finally:
                for slot in clients:
                    await slot.client.close()

        asyncio.run(both())
    finally:
        source.close()
        run.close()
    return window_figures(sink, args.warm, args.steps)


def window_figures(sink: WindowSink, warm: int, last: int) -> dict:
    seconds = sink.times[last] - sink.times[warm]
    steps = range(warm + 1, last + 1)
    busy = sum(b["busy_slot_s"] - a["busy_slot_s"] for a, b in zip(sink.servers[warm], sink.servers[last]))
    capacity = sum(a["max_slots"] * (b["uptime_s"] - a["uptime_s"]) for a, b in zip(sink.servers[warm], sink.servers[last]))
    hist = Counter()
    for s in steps:
        for key, n in sink.rows[s].items():
            if match := re.fullmatch(r"off_policy/tokens_at_(\d+)", key):
                hist[int(match[1])] += n
    total = sum(hist.values())  # every trained completion token, by its off-policy steps
    return {
        "step_time_s": round(seconds / len(steps), 3),
        "utilization": round(busy / capacity, 4),
        "tokens_per_s": round(total / seconds, 1),
        "off_policy_steps_hist": {k: round(n / total, 4) for k, n in sorted(hist.items())},
        "dropped_stale": sink.rows[last]["rollouts/dropped_stale"],
        "failed": sink.rows[last]["rollouts/failed"],
    }


def quickstart_step_time(scheduler_toml: str, steps: int, warm: int, work: Path) -> float:
    """Mean step time of the real quickstart with the ``[scheduler]`` table replaced."""
    text = (ROOT / "examples" / "quickstart.toml").read_text()
    text = re.sub(r"\[scheduler\]\n(?:[^\[]*\n)", scheduler_toml + "\n\n", text)
    name = re.search(r'use = "(\w+)"', scheduler_toml)[1]
    config, out = work / f"quickstart-{name}.toml", work / f"quickstart-{name}"
    config.write_text(text)
    subprocess.run(
        [sys.executable, "-m", "i3core.cli", "--log-level", "warning", "run", str(config),
         "--set", f"run.output_dir='{out}'", "--set", f"run.max_steps={steps}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["time/elapsed_s"] for r in rows}
    return (elapsed[steps] - elapsed[warm]) / (steps - warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="trainer steps per scenario")
    parser.add_argument("--warm", type=int, default=3, help="steps left out of the figures")
    parser.add_argument("--slots", type=int, default=64, help="slots per server (and rollouts per server per step)")
    parser.add_argument("--servers", default="1,2,4,8", help="server counts of the scaling runs")
    parser.add_argument("--train-s", type=float, default=1.0, help="modelled trainer step time")
    parser.add_argument("--step-base-ms", type=float, default=20.0, help="simulated decode step: fixed cost")
    parser.add_argument("--step-per-seq-ms", type=float, default=0.1, help="simulated decode step: per sequence")
    parser.add_argument("--quickstart-steps", type=int, default=40, help="real quickstart steps per scheduler (0: skip)")
    args = parser.parse_args()
    from i3core.cli.log import configure

    configure(level="warning")
    counts = [int(n) for n in args.servers.split(",")]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs["sync-1"] = simulated_run({"use": "sync", "group_size": GROUP_SIZE, "batch_size": args.slots}, 1, args, work)
        print("sync-1", json.dumps(runs["sync-1"]), flush=True)
        for n in counts:
            scheduler = {"use": "async", "group_size": GROUP_SIZE, "batch_size": n * args.slots,
                         "inflight": n * args.slots, "max_async": 1, "max_off_policy_steps": 8}  # fmt: skip
            runs[f"async-{n}"] = simulated_run(scheduler, n, args, work)
            print(f"async-{n}", json.dumps(runs[f"async-{n}"]), flush=True)
        quickstart = None
        if args.quickstart_steps:
            sync_s = quickstart_step_time('[scheduler]\nuse = "sync"\ngroup_size = 8\nbatch_size = 64',
                                          args.quickstart_steps, 5, work)
            async_s = quickstart_step_time(
                '[scheduler]\nuse = "async"\ngroup_size = 8\nbatch_size = 64\ninflight = 128\nmax_async = 1',
                args.quickstart_steps, 5, work,
            )
            quickstart = {"sync_step_s": round(sync_s, 3), "async_step_s": round(async_s, 3),
                          "ratio": round(sync_s / async_s, 3)}  # fmt: skip
    one = runs[f"async-{counts[0]}"]["tokens_per_s"] / counts[0]
    print(
        json.dumps(
            {
                "sync_over_async_step_time": round(runs["sync-1"]["step_time_s"] / runs["async-1"]["step_time_s"], 3),
                "async_utilization": runs["async-1"]["utilization"],
                "sync_utilization": runs["sync-1"]["utilization"],
                "scaling_efficiency": {n: round(runs[f"async-{n}"]["tokens_per_s"] / (n * one), 4) for n in counts},
                "off_policy_steps_hist": runs["async-1"]["off_policy_steps_hist"],
                "quickstart_sync_over_async_step_time": quickstart and quickstart["ratio"],
                "quickstart": quickstart,
                "runs": runs,
                "params": vars(args) | {"lengths": LENGTHS, "group_size": GROUP_SIZE},
            }
        )
    )


if __name__ == "__main__":
    main()
