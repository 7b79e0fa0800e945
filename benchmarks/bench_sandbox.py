"""Sandboxes at concurrency: cold start, exec round trip and memory, per backend, side by side in one run.

For each backend (``local``; ``docker`` where an engine answers, with the test
image of tests/docker_image.py), ``--concurrent`` sandboxes are created, at
most ``--create-parallel`` at a time, and all kept alive together:

- ``cold_start_*``: wall time of each ``create()`` call until the sandbox
  can exec (p50/p99 over every sandbox);
- ``exec_*``: round trip of ``exec(["true"])`` with all the sandboxes alive,
  one call at a time, ``--execs`` calls round robin over the sandboxes, so
  the figure is latency, not queueing;
- ``exec_parallel_per_s``: trivial execs per second with ``--exec-parallel``
  in flight (the throughput side);
- ``rss_mb_per_sandbox``: resident memory of every process that appeared on
  the machine while the sandboxes were made (inits, shims, agents; this
  process's own growth included), over the number of sandboxes;
  ``mem_available_drop_mb_per_sandbox``: the drop of the kernel's
  MemAvailable over the same span (page cache, tmpfs, kernel objects too).

Last line JSON: ``results``, one object per backend with ``backend``,
``concurrent``, ``cold_start_p50_ms``, ``cold_start_p99_ms``, ``exec_p50_ms``,
``exec_p99_ms``, ``rss_mb_per_sandbox`` and the extras above.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' backend builders (and docker's test image) serve the benchmark too

from tests.sandbox_backends import backend_for, docker_available  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def process_rss(exclude: set[int]) -> tuple[int, set[int]]:
    total, pids = 0, set()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in exclude:
            continue
        try:
            total += proc.memory_info().rss
            pids.add(proc.pid)
        except psutil.Error:
            pass
    return total, pids


async def measure(name: str, args, workdir: Path) -> dict:
    backend = backend_for(name, workdir)
    before_pids = {p.pid for p in psutil.process_iter()} - {os.getpid()}
    me = psutil.Process()
    rss_before = me.memory_info().rss
    available_before = psutil.virtual_memory().available
    gate = asyncio.Semaphore(args.create_parallel)
    cold: list[float] = []

    async def create():
        async with gate:
            start = time.perf_counter()
            sandbox = await backend.create()
            cold.append(time.perf_counter() - start)
            return sandbox

    sandboxes = []
    try:
        started = time.perf_counter()
        sandboxes = await asyncio.gather(*(create() for _ in range(args.concurrent)))
        create_all_s = time.perf_counter() - started
        await asyncio.sleep(1.0)  # let the new processes settle before reading their memory
        others, _ = process_rss(before_pids | {os.getpid()})
        rss = others + max(0, me.memory_info().rss - rss_before)
        available_drop = available_before - psutil.virtual_memory().available

        execs = []
        for i in range(args.execs):
            sandbox = sandboxes[i % len(sandboxes)]
            start = time.perf_counter()
            result = await sandbox.exec(["true"], timeout=30)
            execs.append(time.perf_counter() - start)
            if result.exit_code != 0:
                raise RuntimeError(f"{name}: `true` failed in {sandbox.id}: {result}")

        gate = asyncio.Semaphore(args.exec_parallel)

        async def one(i):
            async with gate:
                result = await sandboxes[i % len(sandboxes)].exec(["true"], timeout=60)
            if result.exit_code != 0:
                raise RuntimeError(f"{name}: `true` failed under load: {result}")

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.execs)))
        parallel_per_s = args.execs / (time.perf_counter() - start)
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes), return_exceptions=True)
        await backend.aclose()

    n = len(cold)
    return {
        "backend": name,
        "concurrent": n,
        "cold_start_p50_ms": round(1000 * statistics.median(cold), 1),
        "cold_start_p99_ms": round(1000 * percentile(cold, 99), 1),
        "create_all_s": round(create_all_s, 2),
        "create_parallel": args.create_parallel,
        "exec_p50_ms": round(1000 * statistics.median(execs), 2),
        "exec_p99_ms": round(1000 * percentile(execs, 99), 2),
        "exec_parallel_per_s": round(parallel_per_s, 1),
        "exec_parallel": args.exec_parallel,
        "rss_mb_per_sandbox": round(rss / n / 2**20, 2),
        "mem_available_drop_mb_per_sandbox": round(available_drop / n / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backends", default="local,docker", help="comma-separated; docker is left out "
                        "where no engine answers")  # fmt: skip
    parser.add_argument("--concurrent", type=int, default=256, help="sandboxes alive at once (local)")
    parser.add_argument("--docker-concurrent", type=int, default=256, help="sandboxes alive at once (docker)")
    parser.add_argument("--create-parallel", type=int, default=16, help="create() calls in flight at once")
    parser.add_argument("--execs", type=int, default=512, help="trivial execs timed one at a time")
    parser.add_argument("--exec-parallel", type=int, default=16, help="execs in flight for the throughput figure")
    args = parser.parse_args()
    results = []
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if name == "docker" and not docker_available():
            print("docker: no engine answers here; left out", file=sys.stderr)
            continue
        run_args = argparse.Namespace(**vars(args))
        if name == "docker":
            run_args.concurrent = args.docker_concurrent
        with tempfile.TemporaryDirectory(prefix="i3-bench-sandbox-") as tmp:
            result = asyncio.run(measure(name, run_args, Path(tmp)))
        print(json.dumps(result), file=sys.stderr)
        results.append(result)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
