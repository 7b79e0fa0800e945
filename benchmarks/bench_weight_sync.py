"""Weight sync: how long generation pauses per update, and each transport's bandwidth against memcpy.

For the quickstart model and a ~100M-parameter tiny-moe, for each backend
(``builtin``; ``vllm`` too when ``$I3CORE_VLLM_PYTHON`` names a vLLM environment)
and each transport (``filesystem``, ``broadcast``), one real server process on
127.0.0.1 keeps generating (``--streams`` completions always in flight) while this
process plays trainer rank 0 and pushes ``--updates`` new versions:

- filesystem: write ``step_N/`` (HF safetensors + STABLE) with the weight
  sync, then ``/update_weights {path, version}``; the server reads it under
  its lease while it keeps decoding, then swaps between two steps;
- broadcast: stream the HF tensors layer by layer over the gloo group, then
  ``/update_weights {version}``, which answers once the version is live.

``update_ms`` is trainer-side wall time from the start of a push to the
server's answer (``push_ms``: the part until the trainer's side is done, i.e.
the directory written or the last byte broadcast); ``pause_ms`` is how long the server's engine stood still
swapping (its ``update_pause_s`` per update); ``bandwidth_over_memcpy`` is the
HF bytes of one version / ``update_ms``, over the bytes/s of a plain in-memory
copy of the same bytes measured in the same run (the physical limit on one
machine). Medians over the updates. On vLLM the pause covers the whole update:
the engine pauses (running sequences kept) while its worker reads or receives the
weights. Last line JSON: ``results`` (one object per backend, transport and size:
``backend``, ``transport``, ``params``, ``pause_ms``,
``bandwidth_over_memcpy``, ...) and ``memcpy_gb_s``.
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

import torch

from i3core.plugins.models.tiny_moe import num_parameters
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.plugins.weight_sync.broadcast import Sender
from i3core.testing import make_component

SIZES = {
    "quickstart": {},
    "100M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2, "num_experts": 16,
             "moe_intermediate_size": 480},
}


def memcpy_bytes_per_s(nbytes: int, repeats: int = 5) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


async def keep_generating(client, stop: asyncio.Event) -> int:
    done = 0
    while not stop.is_set():
        await client.complete("abcdef", max_tokens=32, temperature=1.0)
        done += 1
    return done


async def measure(backend: str, transport: str, size: str, updates: int, streams: int, work: Path) -> dict:
    component = make_component("model", "tiny-moe", **SIZES[size])
    models = [component.build(seed=s) for s in range(2)]
    nbytes = sum(t.numel() * t.element_size() for _, t in component.hf_tensors(models[0]))
    root = work / f"{backend}-{transport}-{size}" / "broadcasts"
    sync = make_component("weight_sync", transport, **({"backend": "gloo"} if transport == "broadcast" else {}))
    fs = sync if transport == "filesystem" else make_component("weight_sync", "filesystem", keep=2)
    fs.write(root, 0, lambda d: component.save_hf(models[0], d))
    rendezvous = sync.host(root, receivers=1) if transport == "broadcast" else None
    receiver = sync.receiver(root)
    options = {"python": os.environ.get("I3CORE_VLLM_PYTHON")} if backend == "vllm" else {}
    source = make_component("rollout_source", backend, servers=1, max_slots=streams, max_len=128, **options)
    metrics_path = "/i3/metrics"  # both backends' JSON counters (/metrics is Prometheus text)
    extra = {"receiver": receiver} if receiver else {}
    (url,) = await asyncio.to_thread(source.start, sync.location(root, 0), work / "logs", **extra)
    sender = Sender(rendezvous.path, "gloo") if rendezvous is not None else None
    client = source.client(url, build_tokenizer(), [])
    stop = asyncio.Event()
    generators = [asyncio.create_task(keep_generating(client, stop)) for _ in range(streams)]
    times, pushes, pauses = [], [], []
    try:
        await asyncio.sleep(1.0)  # decoding is under way
        before = first = await client._request("GET", metrics_path)
        for version in range(1, updates + 1):
            model = models[version % 2]
            start = time.perf_counter()
            if sender is None:
                path = await asyncio.to_thread(fs.write, root, version, lambda d, m=model: component.save_hf(m, d))
                pushes.append(time.perf_counter() - start)
                await client.update_weights(str(path), version)
            else:
                await asyncio.to_thread(sender.send, version, component.hf_tensors(model))
                pushes.append(time.perf_counter() - start)
                await client.update_weights(None, version)
            times.append(time.perf_counter() - start)
            now = await client._request("GET", metrics_path)
            pauses.append(now["update_pause_s"] - before["update_pause_s"])
            before = now
        after = now
        stop.set()
        completions = sum(await asyncio.gather(*generators))
    finally:
        stop.set()
        for task in generators:
            task.cancel()
        await client.close()
        source.close()
        if rendezvous is not None:
            rendezvous.close()
    swaps = after["updates"] - first["updates"]
    update_s = statistics.median(times)
    return {
        "backend": backend,
        "transport": transport,
        "params": num_parameters(models[0]),
        "size": size,
        "bytes": nbytes,
        "pause_ms": round(1000 * statistics.median(pauses), 2),
        "pause_ms_max": round(1000 * max(pauses), 2),
        "update_ms": round(1000 * update_s, 1),
        "push_ms": round(1000 * statistics.median(pushes), 1),
        "bytes_per_s": round(nbytes / update_s),
        "updates": swaps,
        "completions_during": completions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4, help="completions kept in flight on the server")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--backends", default="builtin,vllm" if os.environ.get("I3CORE_VLLM_PYTHON") else "builtin",
                        help="builtin and/or vllm (vllm needs $I3CORE_VLLM_PYTHON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        for backend in args.backends.split(","):
            for size in args.sizes.split(","):
                for transport in ("filesystem", "broadcast"):
                    result = asyncio.run(measure(backend, transport, size, args.updates, args.streams, Path(tmp)))
                    print(json.dumps(result), file=sys.stderr, flush=True)
                    results.append(result)
    memcpy = {size: memcpy_bytes_per_s(next(r["bytes"] for r in results if r["size"] == size))
              for size in {r["size"] for r in results}}
    for result in results:
        result["bandwidth_over_memcpy"] = round(result["bytes_per_s"] / memcpy[result["size"]], 4)
    print(json.dumps({"results": results, "memcpy_gb_s": {s: round(b / 1e9, 2) for s, b in memcpy.items()},
                      "params": {"updates": args.updates, "streams": args.streams}}))


if __name__ == "__main__":
    main()
