"""The builtin engine: KV-cache generation that matches the trainer, continuous batching, in-flight updates."""

import math

import pytest
import torch

from i3core.plugins.inference.engine import (PREFILL_PADDING, Engine, Request, Sequence, _truncate, draw,
                                            prefill_batches, process_logits, sample)
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


def test_unseeded_rows_draw_from_their_distribution_never_a_token_of_probability_zero(monkeypatch):
    """The inverse-CDF draw: frequencies within 0.02 of the probabilities over 20,000 rows, no token of probability 0
    ever drawn, a draw that rounds up to a row's total lands on its last token of non-zero probability, and a row that
    cannot be sampled raises (the caller fails it alone)."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).expand(20_000, 5)
    frequencies = torch.bincount(draw(probs), minlength=5) / 20_000
    assert frequencies[1] == frequencies[4] == 0
    assert (frequencies - probs[0]).abs().max() < 0.02
    monkeypatch.setattr(torch, "rand", lambda shape, generator=None: torch.ones(shape))  # the top of [0, 1): u == the total
    assert draw(probs[:2]).tolist() == [3, 3]
    monkeypatch.undo()
    for bad in ([[float("nan"), 0.5]], [[0.0, 0.0]], [[float("inf"), 0.0]]):
        with pytest.raises(ValueError, match="not finite or sum to 0"):
            draw(torch.tensor(bad))


def test_abort_frees_the_slot(builtins):
    engine = Engine(model(builtins), max_slots=1, max_len=64)
    seq = engine.add(Request([1, 2], max_tokens=50))
    engine.step()
    engine.abort(seq)
    assert seq.finish_reason == "abort" and not engine.has_work() and engine._free == [0]


def reference_sample(seq, row):
    """The per-sequence sampler the batched one replaced: one row, its own ops."""
    request = seq.request
    if request.temperature == 0:
        logprobs = torch.log_softmax(row, dim=-1)
        token = int(row.argmax())
    else:
        logprobs = torch.log_softmax(_truncate((row / request.temperature)[None], request.top_k, request.top_p)[0], -1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=seq.generator))
    top = []
    if request.top_logprobs:
        values, ids = logprobs.topk(request.top_logprobs)
        top = list(zip(ids.tolist(), values.tolist()))
    return token, float(logprobs[token]), top


SETTINGS = [
    {"temperature": 0.0, "top_logprobs": 3},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5, "top_logprobs": 2},
    {"temperature": 1.3, "top_p": 0.9},
    {"temperature": 0.9, "top_k": 20, "top_p": 0.5},
]


def test_batched_sampling_equals_the_per_sequence_reference_for_fixed_seeds(builtins):
    engine = Engine(model(builtins), max_slots=4, max_len=64)
    requests = [Request([1], 4, seed=100 + i, **SETTINGS[i % len(SETTINGS)]) for i in range(23)]
    logits = torch.randn(len(requests), 260, generator=torch.Generator().manual_seed(0)) * 3
    batched, alone = [engine.new_sequence(r) for r in requests], [engine.new_sequence(r) for r in requests]
    for _ in range(3):  # generators advance in step
        got = sample(logits, batched)
        want = [reference_sample(seq, row) for seq, row in zip(alone, logits)]
        for (token, logprob, top), (ref_token, ref_logprob, ref_top) in zip(got, want):
            assert token == ref_token
            assert abs(logprob - ref_logprob) < 1e-6
            assert [t for t, _ in top] == [t for t, _ in ref_top]
            assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(top, ref_top))


def test_unseeded_rows_are_drawn_from_their_truncated_distribution(builtins):
    engine = Engine(model(builtins), max_slots=4, max_len=64)
    seqs = [engine.new_sequence(Request([1], 4, temperature=0.8, top_k=3)) for _ in range(64)]
    logits = torch.randn(64, 260, generator=torch.Generator().manual_seed(1))
    for row, (token, logprob, _) in zip(logits, sample(logits, seqs)):
        assert token in row.topk(3).indices.tolist()
        assert abs(logprob - float(torch.log_softmax(_truncate((row / 0.8)[None], 3, 1.0)[0], -1)[token])) < 1e-6


def test_n_sequences_of_one_prompt_share_one_prefill_and_draw_apart(builtins):
    net = model(builtins)
    engine = Engine(net, max_slots=8, max_len=64)
    calls = []
    forward = net.forward_cached
    net.forward_cached = lambda ids, *rest: calls.append(tuple(ids.shape)) or forward(ids, *rest)
    seqs = [engine.add(Request([5, 6, 7, 8], max_tokens=6, seed=i)) for i in range(4)]
    short = engine.add(Request([1, 2], max_tokens=6, seed=9))
    run_all(engine)
    # the shared prompt computed once (its cache entries copied to the other 3 slots) in one forward with the
    # shorter prompt, padded to its length, then one decode of all five
    assert calls[:2] == [(2, 4), (5, 1)]
    assert len({tuple(s.token_ids) for s in seqs}) > 1
    for seq in [*seqs, short]:  # the padded prompt's completion as if it had been alone
        ref = teacher_forced_logprobs(net, seq.request.prompt_ids, seq.token_ids)
        assert (ref - torch.tensor(seq.logprobs)).abs().max() < 1e-4


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(builtins):
    net = model(builtins)
    alone = Engine(net, max_slots=8, max_len=64)
    seq = alone.add(Request([3, 1, 4], max_tokens=10, seed=42, top_p=0.95))
    run_all(alone)
    crowded = Engine(net, max_slots=8, max_len=64)
    others = [crowded.add(Request([2, 7, 1 + i], max_tokens=4 + i, temperature=0.5 + i / 10)) for i in range(5)]
    again = crowded.add(Request([3, 1, 4], max_tokens=10, seed=42, top_p=0.95))
    run_all(crowded)
    assert again.token_ids == seq.token_ids and all(o.finish_reason == "length" for o in others)
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(seq.logprobs), atol=1e-5)


def test_sequences_in_scattered_slots_keep_exact_logprobs(builtins):
    """Sequences that finish early leave holes, so the cache is gathered rather than read in place."""
    net = model(builtins)
    engine = Engine(net, max_slots=6, max_len=64)
    seqs = [engine.add(Request([9, 8, 7 + i % 3], max_tokens=2 + 5 * (i % 2), seed=i)) for i in range(6)]
    late = [engine.add(Request([4, 5], max_tokens=9, seed=10 + i)) for i in range(2)]
    run_all(engine)
    assert [s.slot for s in late] == [0, 2]  # the lowest holes the short ones left: running slots 0-3 and 5
    for seq in seqs + late:
        ref = teacher_forced_logprobs(net, seq.request.prompt_ids, seq.token_ids)
        assert (ref - torch.tensor(seq.logprobs)).abs().max() < 1e-4


def test_prefill_batches_pad_a_few_tokens_never_many():
    seqs = [Sequence(i, Request([1] * n, 4)) for i, n in enumerate([14, 12, 13, 12, 200, 3, 190])]
    batches = prefill_batches(seqs)
    assert sorted(s.id for b in batches for s in b) == list(range(7))  # every sequence, once
    for batch in batches:
        lengths = [len(s.request.prompt_ids) for s in batch]
        assert len(batch) * max(lengths) <= PREFILL_PADDING * sum(lengths)
    # the quickstart's kind of batch, 12-14 tokens, in one forward; 3 tokens and ~200 each apart from it
    assert [[len(s.request.prompt_ids) for s in b] for b in batches] == [[3], [12, 12, 13, 14], [190, 200]]


def test_prompt_logprobs_come_from_the_prefill_and_match_a_full_forward(builtins):
    net = model(builtins)
    engine = Engine(net, max_slots=4, max_len=64)
    prompt = [5, 9, 2, 7, 7, 3]
    asked = [engine.add(Request(prompt, max_tokens=3, seed=i, prompt_logprobs=2)) for i in range(2)]  # shared
    alone = engine.add(Request([4, 4, 1], max_tokens=0, prompt_logprobs=0))
    plain = engine.add(Request(prompt, max_tokens=2, seed=5))
    finished = run_all(engine)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = torch.log_softmax(net.logits(net(ids)).float(), dim=-1)[0]
    reference = [full[i - 1, tok].item() for i, tok in enumerate(prompt) if i]
    for seq in asked:
        assert seq.prompt_logprobs[0] is None and seq.prompt_top_logprobs[0] == []
        assert seq.prompt_logprobs[1:] == [pytest.approx(r, abs=1e-4) for r in reference]
        best = full[:-1].topk(2, dim=-1)
        assert [[t for t, _ in top] for top in seq.prompt_top_logprobs[1:]] == best.indices.tolist()
    assert alone.token_ids == [] and alone.finish_reason == "length" and alone in finished
    assert len(alone.prompt_logprobs) == 3 and all(top == [] for top in alone.prompt_top_logprobs)
    with torch.no_grad():  # prefilled with the longer prompts, padded: its own tokens' logprobs all the same
        short = torch.log_softmax(net.logits(net(torch.tensor([[4, 4, 1]]))).float(), dim=-1)[0]
    assert alone.prompt_logprobs[1:] == [pytest.approx(short[0, 4].item(), abs=1e-4),
                                         pytest.approx(short[1, 1].item(), abs=1e-4)]
    assert plain.prompt_logprobs == [] and len(plain.token_ids) == 2
    assert not engine.running and sorted(engine._free) == list(range(4))  # every slot back


def test_logits_processors_follow_their_definitions_over_a_batch(builtins):
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(4, vocab) * 3

    def seq(prompt, out, **settings):
        return Sequence(0, Request(prompt, 10, **settings), token_ids=list(out))

    seqs = [
        seq([1, 2], [3, 3, 4], presence_penalty=0.5, frequency_penalty=0.25),
        seq([1, 2], [3], repetition_penalty=2.0),
        seq([1], [], logit_bias={5: 7.0, 6: -100.0}, min_tokens=2, stop_token_ids=(0, 11)),
        seq([1], [2]),  # no processor: untouched
    ]
    out = process_logits(logits, seqs)
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.25 + 0.5
    expected[0, 4] -= 0.25 + 0.5
    for token in (1, 2, 3):
        value = logits[1, token]
        expected[1, token] = value / 2 if value > 0 else value * 2
    expected[2, 5] += 7.0
    expected[2, 6] -= 100.0
    expected[2, [0, 11]] = -math.inf
    assert torch.equal(out, expected)
    seqs[2].token_ids = [4, 4]  # min_tokens reached: the stop tokens are back
    assert torch.isfinite(process_logits(logits, seqs)[2]).all()


def test_min_tokens_and_logit_bias_steer_the_engine(builtins):
    engine = Engine(model(builtins), max_slots=4, max_len=64)
    greedy = engine.add(Request([1, 2, 3], max_tokens=4, temperature=0))
    run_all(engine)
    first = greedy.token_ids[0]
    held = engine.add(Request([1, 2, 3], max_tokens=4, temperature=0, stop_token_ids=(first,), min_tokens=2))
    forced = engine.add(Request([1, 2, 3], max_tokens=3, temperature=1.0, seed=1, logit_bias={9: 100.0}))
    run_all(engine)
    assert held.token_ids[0] != first and len(held.token_ids) >= 2
    assert forced.token_ids == [9, 9, 9] and forced.logprobs == pytest.approx([0.0] * 3, abs=1e-4)
