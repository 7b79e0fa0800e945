"""Weight syncs: filesystem (complete versions only, leases against pruning) and broadcast (real gloo groups)."""

import multiprocessing
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from i3core.plugins.models.tiny_moe.hf import iter_hf_tensors
from i3core.plugins.weight_sync.broadcast import Receiver, Sender, layer_chunks
from i3core.weights import STABLE, VersionGone, reading, write_safetensors
from i3core.testing import make_component


def _save_bytes(data: str):
    def save(directory):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_text(data)

    return save


def test_write_safetensors_is_read_back_by_safetensors(tmp_path):
    """Views of one storage, a transposed (non-contiguous) tensor, a scalar, an empty tensor and several dtypes come
    back from safetensors' own reader as they were written, with the metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    stack = torch.randn(4, 6)
    tensors = {"first": stack[:2], "second": stack[2:], "transposed": torch.randn(3, 5).T, "scalar": torch.tensor(3.5),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False]), "half": torch.randn(7).bfloat16(),
               "ids": torch.arange(5)}
    path = tmp_path / "model.safetensors"
    write_safetensors(tensors, path, metadata={"format": "pt"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(str(path), "pt") as file:
        assert file.metadata() == {"format": "pt"}


def test_write_marks_stable_and_keeps_the_newest(builtins, tmp_path):
    sync = make_component("weight_sync", "filesystem", plugins=builtins, keep=2)
    seen_during_save = []

    def save(directory):
        seen_during_save.append(sync.is_ready(tmp_path, version))
        _save_bytes("x")(directory)

    for version in range(4):
        path = sync.write(tmp_path, version, save)
        assert sync.is_ready(tmp_path, version) and (path / "model.safetensors").exists()
    assert seen_during_save == [False] * 4  # never ready before it is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


def test_rewriting_a_version_replaces_it(builtins, tmp_path):
    sync = make_component("weight_sync", "filesystem", plugins=builtins)
    sync.write(tmp_path, 0, _save_bytes("old"))
    sync.write(tmp_path, 0, _save_bytes("new"))
    assert (sync.location(tmp_path, 0) / "model.safetensors").read_text() == "new"


def test_a_version_a_reader_holds_is_not_pruned_until_it_lets_go(builtins, tmp_path):
    """The reader is another process (a server) holding the lease; the trainer keeps publishing."""
    sync = make_component("weight_sync", "filesystem", plugins=builtins, keep=1)
    sync.write(tmp_path, 0, _save_bytes("v0"))
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from i3core.weights import reading
            with reading(Path({str(tmp_path / 'step_0')!r})) as path:
                print("reading", flush=True)
                sys.stdin.readline()
                print((path / "model.safetensors").read_text(), flush=True)
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert reader.stdout.readline().strip() == "reading"
        sync.write(tmp_path, 1, _save_bytes("v1"))
        sync.write(tmp_path, 2, _save_bytes("v2"))
        assert sync.is_ready(tmp_path, 0), "pruned while a server was reading it"
        assert not sync.location(tmp_path, 1).exists()
        out, _ = reader.communicate("go\n", timeout=30)
        assert out.strip() == "v0" and reader.returncode == 0
    finally:
        reader.kill()
    sync.write(tmp_path, 3, _save_bytes("v3"))  # the next publish catches up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_readers_never_open_an_unfinished_or_pruned_version(builtins, tmp_path):
    sync = make_component("weight_sync", "filesystem", plugins=builtins, keep=1)
    (tmp_path / "step_0").mkdir()  # a publish that crashed before STABLE
    with pytest.raises(VersionGone, match="STABLE"):
        with reading(tmp_path / "step_0"):
            pass
    sync.write(tmp_path, 1, _save_bytes("v1"))
    assert not (tmp_path / "step_0").exists()  # the crashed one is cleaned up
    sync.write(tmp_path, 2, _save_bytes("v2"))
    with pytest.raises(VersionGone):
        with reading(tmp_path / "step_1"):
            pass
    with reading(tmp_path / "step_2") as path:
        assert (path / STABLE).exists()


# -- broadcast -------------------------------------------------------------------------------------------


SMALL = {"hidden_size": 64, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


def test_layer_chunks_keep_each_layer_together():
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.layers.10.a", "model.norm.weight", "lm_head.weight"]
    chunks = [[n for n, _ in c] for c in layer_chunks((n, torch.zeros(1)) for n in names)]
    assert chunks == [names[:1], names[1:3], names[3:4], names[4:5], names[5:6], names[6:]]


def _receive(rendezvous, rank, rounds, queue):
    receiver = Receiver(rendezvous, rank, "gloo", timeout_s=60)
    for _ in range(rounds):
        version, tensors = receiver.receive()
        queue.put((rank, version, {n: t.tolist() for n, t in tensors.items()}))


def test_broadcast_delivers_every_tensor_to_every_receiver(builtins, tmp_path):
    """Trainer rank 0 and two receiver processes in one gloo group; two rounds, bf16 and fp32 mixed."""
    sync = make_component("weight_sync", "broadcast", plugins=builtins, backend="gloo")
    rendezvous = sync.host(tmp_path, receivers=2)
    model = make_component("model", "tiny-moe", **SMALL).build(seed=0)
    first = dict(iter_hf_tensors(model))
    second = {**first, "model.norm.weight": first["model.norm.weight"].to(torch.bfloat16) + 1}
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    members = [ctx.Process(target=_receive, args=(rendezvous.path, r, 2, queue)) for r in (1, 2)]
    for p in members:
        p.start()
    alive, peak = [], [0]

    def stream(tensors):  # fresh copies, so what the sender still holds can be counted
        for name, tensor in tensors.items():
            tensor = tensor.clone()
            alive.append(weakref.ref(tensor))
            peak[0] = max(peak[0], sum(r().nbytes for r in alive if r() is not None))
            yield name, tensor
            del tensor

    try:
        sender = Sender(rendezvous.path, "gloo", timeout_s=60)
        sent = sender.send(7, stream(first))
        sender.send(8, second.items())
        got = [queue.get(timeout=120) for _ in range(4)]
    finally:
        for p in members:
            p.join(timeout=30)
            p.kill()
        rendezvous.close()
    assert sent == sum(t.numel() * t.element_size() for t in first.values())
    layer = max(sum(t.nbytes for _, t in chunk) for chunk in layer_chunks(first.items()))
    lookahead = max(t.nbytes for t in first.values())  # a layer ends when the next one's first tensor is read
    assert peak[0] <= layer + lookahead, (peak[0], layer)  # never more than one layer held
    for rank, version, tensors in got:
        expected = first if version == 7 else second
        assert set(tensors) == set(expected)
        for name, value in tensors.items():
            assert torch.equal(torch.tensor(value, dtype=expected[name].dtype), expected[name]), name
    assert sorted((r, v) for r, v, _ in got) == [(1, 7), (1, 8), (2, 7), (2, 8)]
