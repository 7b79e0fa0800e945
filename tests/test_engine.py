"""The builtin engine: KV-cache generation that matches the trainer, continuous batching, in-flight updates."""

import torch

from i3core.plugins.inference.engine import Engine, Request
from i3core.testing import make_component

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


def model(builtins, seed=0):
    return make_component("model", "tiny-moe", plugins=builtins, **SMALL).build(seed=seed)


def run_all(engine):
    done = []
    for _ in range(1000):
        if not engine.has_work():
            break
        done += engine.step()
    return done


def teacher_forced_logprobs(net, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(net.logits(net(ids)).float(), dim=-1)[0]
    n = len(prompt)
    return torch.stack([logprobs[n - 1 + i, tok] for i, tok in enumerate(completion)])


def test_engine_logprobs_match_a_full_forward(builtins):
    net = model(builtins)
    engine = Engine(net, max_slots=4, max_len=128)
    seqs = [engine.add(Request([5 + i, 6, 7, 8], max_tokens=12, seed=i)) for i in range(3)]
    run_all(engine)
    for seq in seqs:
        ref = teacher_forced_logprobs(net, seq.request.prompt_ids, seq.token_ids)
        assert (ref - torch.tensor(seq.logprobs)).abs().mean() < 1e-4
        assert seq.finish_reason == "length" and len(seq.token_ids) == 12


def test_requests_join_and_leave_between_steps(builtins):
    engine = Engine(model(builtins), max_slots=2, max_len=64)
    short = engine.add(Request([1, 2], max_tokens=3, seed=0))  # prefill + decode give 2 tokens a step first
    long = engine.add(Request([3, 4], max_tokens=10, seed=1))
    late = engine.add(Request([5, 6], max_tokens=3, seed=2))
    engine.step()
    assert late.slot == -1 and {short.id, long.id} == set(engine.running)  # no free slot yet
    finished = engine.step()
    assert finished == [short]
    engine.step()
    assert late.id in engine.running and late.slot == short.slot  # took the freed slot at once
    assert long.id in engine.running
    run_all(engine)
    assert [len(s.token_ids) for s in (short, long, late)] == [3, 10, 3]


def test_stop_tokens_and_greedy(builtins):
    net = model(builtins)
    engine = Engine(net, max_slots=1, max_len=64)
    greedy = engine.add(Request([1, 2, 3], max_tokens=5, temperature=0))
    run_all(engine)
    first = greedy.token_ids[0]
    stopped = engine.add(Request([1, 2, 3], max_tokens=5, temperature=0, stop_token_ids=(first,)))
    run_all(engine)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_weights_swap_mid_sequence_and_tokens_carry_the_new_version(builtins):
    engine = Engine(model(builtins, seed=0), max_slots=2, max_len=64)
    seq = engine.add(Request([1, 2, 3], max_tokens=8, seed=0))
    for _ in range(3):
        engine.step()
    engine.load_state(model(builtins, seed=1).state_dict(), version=1)
    run_all(engine)
    assert seq.versions == [0, 0, 0, 0, 1, 1, 1, 1]


def test_abort_frees_the_slot(builtins):
    engine = Engine(model(builtins), max_slots=1, max_len=64)
    seq = engine.add(Request([1, 2], max_tokens=50))
    engine.step()
    engine.abort(seq)
    assert seq.finish_reason == "abort" and not engine.has_work() and engine._free == [0]
