"""``[trainer] stream_groups``: a batch handed to the trainer in parts trains exactly as the whole batch does."""

import pytest
import torch

from i3core.loop.packing import Sample, concat, pack
from i3core.types import TrainBatch

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def samples(seed: int, count: int, vocab: int) -> list[Sample]:
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompt, completion = int(torch.randint(3, 9, (), generator=rng)), int(torch.randint(2, 20, (), generator=rng))
        ids = torch.randint(1, vocab, (prompt + completion,), generator=rng).tolist()
        logprobs = (-torch.rand(prompt + completion, generator=rng) * 3).tolist()
        out.append(Sample(ids, [False] * prompt + [True] * completion, logprobs, [0] * (prompt + completion),
                          advantage=float(torch.randn((), generator=rng))))
    return out


def test_concat_numbers_samples_on_and_keeps_padding_one_extra_sample():
    first, second = pack(samples(0, 3, 50), 48), pack(samples(1, 4, 50), 48)
    whole = concat([first, second])
    assert whole.num_samples == 7
    assert whole.input_ids.shape[0] == first.input_ids.shape[0] + second.input_ids.shape[0]
    rows = first.input_ids.shape[0]
    assert torch.equal(whole.input_ids[:rows], first.input_ids)
    assert torch.equal(whole.input_ids[rows:], second.input_ids)
    pad_first, pad_second = first.sequence_ids == 3, second.sequence_ids == 4
    assert torch.equal(whole.sequence_ids[:rows][pad_first], torch.full((int(pad_first.sum()),), 7))
    assert torch.equal(whole.sequence_ids[:rows][~pad_first], first.sequence_ids[~pad_first])
    assert torch.equal(whole.sequence_ids[rows:][~pad_second], second.sequence_ids[~pad_second] + 3)
    assert torch.equal(whole.sequence_ids[rows:][pad_second], torch.full((int(pad_second.sum()),), 7))


def trainer(builtins, tmp_path, loss: str, **options):
    from i3core.config import validate
    from i3core.loop.trainer import Trainer

    config = validate({"run": {"output_dir": str(tmp_path)}, "model": {"use": "tiny-moe", **SMALL},
                       "env": {"use": "reverse-text"}, "weight_sync": {"use": "filesystem"}, "loss": {"use": loss},
                       "optimizer": {"use": "adamw"},
                       "trainer": {"micro_batch_rows": 2, **options}}, builtins)
    trainer = Trainer(config)
    optimizer = config.get("optimizer").build().build(trainer.model.named_parameters())
    return trainer, config.get("loss").build(), optimizer


def sampled_by(model, batch: TrainBatch, seed: int) -> TrainBatch:
    """``batch`` with the inference logprobs of ``model`` itself, off by a little (so no loss masks or clips them)."""
    from i3core.loop.trainer import token_logprobs

    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.position_ids, 64)
    noise = 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed))
    batch.inference_logprobs = torch.where(batch.loss_mask, lp + noise, torch.zeros_like(lp))
    return batch


@pytest.mark.parametrize("loss", ["icepop", "gspo"])
def test_a_batch_trained_in_parts_steps_as_the_whole_batch(builtins, tmp_path, loss):
    """The parts' gradients are summed unnormalised and divided by the whole batch's normaliser at the end: the
    same update as the whole batch in one go (to float rounding), the same metrics."""
    from i3core.loop.trainer import StepSums

    whole_trainer, loss_fn, whole_opt = trainer(builtins, tmp_path / "whole", loss)
    model = whole_trainer.model
    parts = [sampled_by(model, pack(samples(seed, 5, 200), 64), seed) for seed in (1, 2)]
    rest = sampled_by(model, pack(samples(3, 6, 200), 64), 3)
    batch = concat([*parts, rest])
    batch.streamed_rows = sum(p.input_ids.shape[0] for p in parts)
    assert batch.streamed_rows > 2  # more than one micro-batch came early
    plain = TrainBatch(**{k: v for k, v in vars(batch).items() if k != "streamed_rows"})
    whole = whole_trainer.train_step(plain, loss_fn, whole_opt, version=0)

    streamed_trainer, loss_fn, streamed_opt = trainer(builtins, tmp_path / "streamed", loss)
    sums = StepSums()
    for part in parts:
        streamed_trainer.accumulate_part(part, loss_fn, streamed_opt, 0, sums)
    streamed = streamed_trainer.train_step(batch, loss_fn, streamed_opt, version=0, streamed=sums)

    assert streamed["train/streamed_rows"] == batch.streamed_rows and whole["train/streamed_rows"] == 0
    for key in ("loss", "grad_norm", "mismatch/kl", "train/loss_tokens"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-9), key
    # the gradients the optimizer stepped on (Adam's first step, about lr * sign(g), would magnify rounding)
    scale = max(float(p.grad.abs().max()) for p in whole_trainer.model.parameters() if p.grad is not None)
    for (name, a), b in zip(whole_trainer.model.named_parameters(), streamed_trainer.model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=scale * 1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    lr = whole_opt.param_groups[0]["lr"]
    fresh = trainer(builtins, tmp_path / "fresh", loss)[0].model
    moved = max(float((a - b).detach().abs().max()) for a, b in zip(whole_trainer.model.parameters(),
                                                                     fresh.parameters()))
    assert moved > lr / 2  # the step did move the weights


def test_parts_that_do_not_match_the_batch_are_trained_again(builtins, tmp_path):
    from i3core.loop.trainer import StepSums

    whole_trainer, loss_fn, whole_opt = trainer(builtins, tmp_path / "whole", "icepop")
    batch = sampled_by(whole_trainer.model, pack(samples(4, 8, 200), 64), 4)
    whole = whole_trainer.train_step(batch, loss_fn, whole_opt, version=0)
    other, loss_fn, other_opt = trainer(builtins, tmp_path / "other", "icepop")
    sums = StepSums()
    stray = sampled_by(other.model, pack(samples(5, 3, 200), 64), 5)  # a part this batch never had
    other.accumulate_part(stray, loss_fn, other_opt, 0, sums)
    again = other.train_step(batch, loss_fn, other_opt, version=0, streamed=sums)
    assert again["loss"] == pytest.approx(whole["loss"], rel=1e-6) and whole["grad_norm"] > 0
    for a, b in zip(whole_trainer.model.parameters(), other.model.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)
