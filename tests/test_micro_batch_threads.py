"""``[trainer] micro_batch_threads``: micro-batches run at once on threads step as they do one after another."""

import threading

import pytest
import torch

from i3core.loop.packing import concat, pack
from tests.test_stream_groups import one_thread, samples, sampled_by, trainer  # noqa: F401 (one_thread: a fixture)


def forward_threads(model) -> set[str]:
    """The names of the threads the model's forwards run on, from now on."""
    names: set[str] = set()
    model.register_forward_pre_hook(lambda module, args: names.add(threading.current_thread().name))
    return names


@pytest.mark.parametrize("threads", [2, 3])
def test_micro_batches_on_threads_step_as_one_after_another(builtins, tmp_path, threads):
    one, loss_fn, one_opt = trainer(builtins, tmp_path / "one", "icepop")
    batch = sampled_by(one.model, pack(samples(7, 24, 200), 64), 7)
    assert batch.input_ids.shape[0] >= 2 * threads  # every thread gets rows
    serial = one.train_step(batch, loss_fn, one_opt, version=0)

    many, loss_fn, many_opt = trainer(builtins, tmp_path / "many", "icepop", micro_batch_threads=threads)
    ran_on = forward_threads(many.model)
    parallel = many.train_step(batch, loss_fn, many_opt, version=0)

    assert len({name for name in ran_on if name.startswith("micro-batch")}) == threads
    for key in ("loss", "grad_norm", "mismatch/kl", "mismatch/mean_abs_logprob_diff", "train/loss_tokens",
                "loss/masked_low_frac"):
        assert parallel[key] == pytest.approx(serial[key], rel=1e-5, abs=1e-9), key
    scale = max(float(p.grad.abs().max()) for p in one.model.parameters() if p.grad is not None)
    for (name, a), b in zip(one.model.named_parameters(), many.model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:  # summed in another order: equal to float rounding
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=scale * 1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_streamed_parts_run_on_the_threads_too(builtins, tmp_path):
    from i3core.loop.trainer import StepSums

    one, loss_fn, one_opt = trainer(builtins, tmp_path / "one", "icepop")
    part = sampled_by(one.model, pack(samples(8, 12, 200), 64), 8)
    rest = sampled_by(one.model, pack(samples(9, 12, 200), 64), 9)
    batch = concat([part, rest])
    batch.streamed_rows = part.input_ids.shape[0]
    sums = StepSums()
    one.accumulate_part(part, loss_fn, one_opt, 0, sums)
    serial = one.train_step(batch, loss_fn, one_opt, version=0, streamed=sums)

    many, loss_fn, many_opt = trainer(builtins, tmp_path / "many", "icepop", micro_batch_threads=2)
    ran_on = forward_threads(many.model)
    sums = StepSums()
    many.accumulate_part(part, loss_fn, many_opt, 0, sums)
    assert len([name for name in ran_on if name.startswith("micro-batch")]) == 2
    parallel = many.train_step(batch, loss_fn, many_opt, version=0, streamed=sums)
    for key in ("loss", "grad_norm", "train/streamed_rows"):
        assert parallel[key] == pytest.approx(serial[key], rel=1e-5), key


def test_one_thread_runs_the_micro_batches_on_the_callers(builtins, tmp_path):
    one, loss_fn, one_opt = trainer(builtins, tmp_path / "one", "icepop")
    assert one.micro_batch_pool is None
    ran_on = forward_threads(one.model)
    one.train_step(sampled_by(one.model, pack(samples(3, 8, 200), 64), 3), loss_fn, one_opt, version=0)
    assert ran_on == {threading.current_thread().name}
