"""The simulated rollout source: its time and length model, exact logprobs, in-flight versions, a real server."""

import asyncio
import math
import random
import time

import aiohttp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from i3core.plugins.inference.engine import Request
from i3core.plugins.inference.simulated import SimEngine, TimingModel, draw_length
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.weights import STABLE
from i3core.testing import make_component

STOP = 5


def engine(**timing) -> SimEngine:
    model = TimingModel(**{"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "prefill_per_token_ms": 0.0,
                           "update_pause_ms": 0.0, **timing})
    return SimEngine(model, vocab_size=300, sample_vocab=260, max_slots=4, max_len=2048)


def drain(eng: SimEngine, limit: int = 10_000) -> int:
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        assert steps < limit
    return steps


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 200), st.integers(0, 400), st.floats(0.0, 3.0), st.integers(0, 2**31))
def test_lengths_stay_inside_the_truncation_bounds(low, span, sigma, seed):
    model = TimingModel(length_min=low, length_max=low + span, length_median=low + span / 3 + 1, length_sigma=sigma)
    rng = random.Random(seed)
    assert all(low <= draw_length(rng, model) <= low + span for _ in range(20))


def test_each_sequence_ends_on_a_stop_token_at_its_drawn_length_with_exact_logprobs():
    eng = engine(length_min=5, length_median=12, length_max=40)
    seqs = [eng.add(Request([1, 2, 3], max_tokens=1000, stop_token_ids=(STOP, 7))) for _ in range(6)]
    drain(eng)
    for seq in seqs:
        assert seq.finish_reason == "stop" and seq.token_ids[-1] == STOP
        assert 5 <= len(seq.token_ids) <= 40
        assert STOP not in seq.token_ids[:-1] and 7 not in seq.token_ids[:-1]
        # every non-final token's logprob is that of the stop-masked bigram row it was drawn from
        prev = [3, *seq.token_ids[:-1]]
        for last, token, logprob in zip(prev, seq.token_ids[:-1], seq.logprobs[:-1]):
            row = eng.logits[last].clone()
            row[[STOP, 7]] = -math.inf
            assert math.isclose(float(torch.log_softmax(row, -1)[token]), logprob, abs_tol=1e-5)
        assert all(0 <= t < 260 for t in seq.token_ids)


def test_max_tokens_cuts_a_sequence_short():
    eng = engine(length_min=100, length_median=200, length_max=300)
    seq = eng.add(Request([1], max_tokens=10, stop_token_ids=(STOP,)))
    drain(eng)
    assert seq.finish_reason == "length" and len(seq.token_ids) == 10


def test_step_time_follows_the_model():
    eng = engine(step_base_ms=20, step_per_seq_ms=5, length_min=10, length_median=10, length_max=10, length_sigma=0)
    for _ in range(4):
        eng.add(Request([1, 2], max_tokens=100, stop_token_ids=(STOP,)))
    start = time.perf_counter()
    steps = drain(eng)
    elapsed = time.perf_counter() - start
    assert steps == 10
    assert 10 * (0.020 + 4 * 0.005) <= elapsed < 10 * (0.020 + 4 * 0.005) + 0.3


def test_a_weight_update_between_steps_changes_the_version_and_the_table():
    eng = engine(length_min=30, length_median=30, length_max=30, length_sigma=0)
    seq = eng.add(Request([1], max_tokens=100, stop_token_ids=(STOP,)))
    for _ in range(10):
        eng.step()
    before = eng.logits.clone()
    eng.load_state(None, 4)
    drain(eng)
    assert seq.versions == [0] * 10 + [4] * 20
    assert not torch.equal(before, eng.logits)


def test_stage_rejects_missing_or_corrupt_weights(tmp_path):
    eng = engine()
    with pytest.raises(ValueError, match="no model.safetensors"):
        eng.stage(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        eng.stage(tmp_path)


@pytest.mark.slow
def test_the_simulated_source_serves_the_builtin_api_with_slot_metrics(tmp_path):
    component = make_component("model", "tiny-moe")
    component.save_hf(component.build(), tmp_path / "v0")
    (tmp_path / "v0" / STABLE).write_text("")
    source = make_component("rollout_source", "simulated", servers=1, max_slots=4,
                            timing={"step_base_ms": 5, "length_min": 5, "length_median": 10, "length_max": 20})
    (url,) = source.start(tmp_path / "v0", tmp_path / "logs")
    tokenizer = build_tokenizer()

    async def scenario():
        client = source.client(url, tokenizer, [STOP])
        try:
            done = await asyncio.gather(*(client.complete("abc", max_tokens=100, temperature=1.0) for _ in range(8)))
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/update_weights", json={"path": str(tmp_path), "version": 1}) as bad:
                    assert bad.status == 400
                async with session.get(url + "/i3/metrics") as response:
                    metrics = await response.json()
            await client.update_weights(str(tmp_path / "v0"), 1)
            after = await client.complete("abc", max_tokens=100, temperature=1.0)
            return done, metrics, after
        finally:
            await client.close()

    try:
        done, metrics, after = asyncio.run(scenario())
    finally:
        source.close()
    assert all(c.finish_reason == "stop" and 5 <= len(c.token_ids) <= 20 for c in done)
    assert all(c.versions == [0] * len(c.token_ids) for c in done)
    assert after.versions == [1] * len(after.token_ids)
    assert 0 < metrics["busy_slot_s"] <= metrics["max_slots"] * metrics["uptime_s"]
    assert metrics["tokens_generated"] == sum(len(c.token_ids) for c in done)
