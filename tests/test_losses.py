"""Every loss against gradients computed by hand, micro-batch additivity, and a masking property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from i3core.errors import ConfigError
from i3core.testing import make_component
from i3core.types import LossInputs

LOSSES = ["icepop", "cispo", "gspo", "grpo", "pg"]


def inputs(trainer, inference, advantages, mask, seq, num=None):
    logp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    return logp, LossInputs(
        trainer_logprobs=logp,
        inference_logprobs=torch.tensor(inference, dtype=torch.float64),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        loss_mask=torch.tensor(mask),
        sequence_ids=torch.tensor(seq),
        num_loss_tokens=num,
    )


def grad(loss_fn, *args, **kwargs):
    logp, x = inputs(*args, **kwargs)
    out = loss_fn(x)
    out.loss.backward()
    return logp.grad, out


def test_icepop_masks_outside_the_band_and_keeps_the_bounds(builtins):
    loss_fn = make_component("loss", "icepop", plugins=builtins)
    ln = math.log
    # ratios: 1.0, 0.5 (on the low bound), 5.0 (on the high bound), 0.4 (masked), 6.0 (masked), prompt token
    trainer = [0.0, ln(0.5), ln(5.0), ln(0.4), ln(6.0), 0.0]
    logp, x = inputs(
        trainer, [0.0] * 6, [1.0, 2.0, -1.0, 3.0, 3.0, 9.0], [True] * 5 + [False], [0, 0, 0, 1, 1, 1]
    )
    out = loss_fn(x)
    out.loss.backward()
    n = 5
    expected = torch.tensor([-1.0 * 1 / n, -0.5 * 2 / n, 5.0 / n, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected)
    assert out.loss.item() == pytest.approx(-(1.0 * 1 + 0.5 * 2 + 5.0 * -1) / n)
    assert out.metrics["loss/masked_low_frac"] == pytest.approx(1 / 5)
    assert out.metrics["loss/masked_high_frac"] == pytest.approx(1 / 5)


def test_icepop_kills_a_sample_below_the_min_ratio(builtins):
    loss_fn = make_component("loss", "icepop", plugins=builtins, rollout_min_ratio=1e-3)
    logp, x = inputs(
        [0.0, math.log(1e-4), 0.0, 0.0], [0.0] * 4, [1.0, 1.0, 1.0, 1.0], [True] * 4, [0, 0, 1, 1]
    )
    out = loss_fn(x)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.0, -0.25, -0.25], dtype=torch.float64))
    assert out.metrics["loss/masked_sample_frac"] == 0.5


def test_icepop_nonfinite_inference_logprob_is_dropped_not_nan(builtins):
    loss_fn = make_component("loss", "icepop", plugins=builtins)
    logp, x = inputs([0.0, 0.0, 50.0], [float("nan"), 0.0, -60.0], [1.0, 1.0, 1.0], [True] * 3, [0, 0, 0])
    out = loss_fn(x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert torch.allclose(logp.grad, torch.tensor([0.0, -0.5, 0.0], dtype=torch.float64))
    assert out.metrics["loss/nonfinite_tokens"] == 1.0


def test_icepop_uses_the_global_normaliser(builtins):
    loss_fn = make_component("loss", "icepop", plugins=builtins)
    logp, x = inputs([0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [True, True], [0, 0], num=8)
    loss_fn(x).loss.backward()
    assert torch.allclose(logp.grad, torch.full((2,), -1 / 8, dtype=torch.float64))


def test_icepop_config_errors(builtins):
    with pytest.raises(ConfigError, match="mask_low"):
        make_component("loss", "icepop", plugins=builtins, mask_low=2.0, mask_high=1.0)
    with pytest.raises(ConfigError, match="unknown key"):
        make_component("loss", "icepop", plugins=builtins, clip=0.2)


def test_cispo_clips_the_weight_but_keeps_every_token(builtins):
    loss_fn = make_component("loss", "cispo", plugins=builtins, eps_low=0.2, eps_high=0.28)
    ln = math.log
    # ratios 1.0, 2.0 (clipped to 1.28), 0.5 (clipped to 0.8); a prompt token
    g, out = grad(loss_fn, [0.0, ln(2.0), ln(0.5), 0.0], [0.0] * 4, [1.0, 1.0, -2.0, 5.0], [True] * 3 + [False],
                  [0, 0, 1, 1])
    assert torch.allclose(g, torch.tensor([-1.0 / 3, -1.28 / 3, 0.8 * 2 / 3, 0.0], dtype=torch.float64))
    assert out.metrics["loss/clipped_frac"] == pytest.approx(2 / 3)


def test_grpo_zeroes_the_gradient_only_where_the_clip_binds(builtins):
    loss_fn = make_component("loss", "grpo", plugins=builtins, eps_low=0.2, eps_high=0.2)
    ln = math.log
    # r=1.5, A>0: clipped -> 0 grad.  r=1.5, A<0: min picks r*A -> grad.  r=0.5, A<0: clipped -> 0.  r=0.5, A>0: grad.
    g, _ = grad(loss_fn, [ln(1.5), ln(1.5), ln(0.5), ln(0.5)], [0.0] * 4, [1.0, -1.0, -1.0, 1.0], [True] * 4,
                [0, 1, 2, 3])
    assert torch.allclose(g, torch.tensor([0.0, 1.5 / 4, 0.0, -0.5 / 4], dtype=torch.float64))


def test_gspo_uses_one_ratio_per_sample(builtins):
    loss_fn = make_component("loss", "gspo", plugins=builtins, eps_low=0.1, eps_high=0.1)
    # sample 0: log-ratios 0.02, 0.04 -> s = exp(0.03), A = 1 (inside the clip): grad -s/N on both tokens
    # sample 1: log-ratios 0.5, 0.5 -> s = exp(0.5) > 1.1 with A > 0: clipped, no gradient
    # sample 2: one token, A = -1, s = exp(-0.05): grad +s/N
    g, out = grad(loss_fn, [0.02, 0.04, 0.5, 0.5, -0.05, 0.0], [0.0] * 6, [1.0, 1.0, 2.0, 2.0, -1.0, 9.0],
                  [True] * 5 + [False], [0, 0, 1, 1, 2, 2])
    s0, s2 = math.exp(0.03), math.exp(-0.05)
    expected = torch.tensor([-s0 / 5, -s0 / 5, 0.0, 0.0, s2 / 5, 0.0], dtype=torch.float64)
    assert torch.allclose(g, expected)
    assert out.metrics["loss/clipped_sample_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", LOSSES)
def test_on_policy_gradient_is_minus_advantage_over_n(builtins, name):
    """With trainer == inference every loss is the plain policy gradient -A_t / N."""
    loss_fn = make_component("loss", name, plugins=builtins)
    g, out = grad(loss_fn, [-1.0, -2.0, -0.5, -0.3], [-1.0, -2.0, -0.5, -0.3], [0.5, 0.5, -1.0, 2.0],
                  [False, True, True, True], [0, 0, 1, 2])
    assert torch.allclose(g, torch.tensor([0.0, -0.5 / 3, 1.0 / 3, -2.0 / 3], dtype=torch.float64))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("name", LOSSES)
def test_nonfinite_inference_logprobs_are_dropped(builtins, name):
    loss_fn = make_component("loss", name, plugins=builtins)
    g, out = grad(loss_fn, [0.0, 0.0, 0.0], [float("nan"), float("-inf"), 0.0], [1.0, 1.0, 1.0], [True] * 3,
                  [0, 0, 0])
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert g[0] == 0 and g[1] == 0 and g[2] != 0
    assert out.metrics["loss/nonfinite_tokens"] == 2.0


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_sum_to_the_full_batch_gradient(builtins, name):
    loss_fn = make_component("loss", name, plugins=builtins)
    gen = torch.Generator().manual_seed(0)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    trainer = (torch.randn(10, generator=gen, dtype=torch.float64) * 0.1 - 1.0).tolist()
    inference = (torch.tensor(trainer, dtype=torch.float64) + torch.randn(10, generator=gen, dtype=torch.float64) * 0.05).tolist()
    advantages = [0.3, 0.3, 0.3, -0.7, -0.7, 1.2, 1.2, 1.2, 1.2, -0.1]
    mask = [False, True, True, False, True, False, True, True, True, True]
    full, _ = grad(loss_fn, trainer, inference, advantages, mask, seq.tolist())
    n = sum(mask)
    parts = []
    for span in (slice(0, 5), slice(5, 10)):  # split on a sample boundary, as packed rows are
        g, _ = grad(loss_fn, trainer[span], inference[span], advantages[span], mask[span],
                    (seq[span] - seq[span].min()).tolist(), num=n)
        parts.append(g)
    assert torch.allclose(torch.cat(parts), full)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(LOSSES),
    st.lists(
        st.tuples(st.floats(-3, 0), st.floats(-3, 0), st.floats(-2, 2), st.booleans()), min_size=1, max_size=12
    ),
)
def test_masked_tokens_never_receive_gradient(name, tokens):
    loss_fn = make_component("loss", name)
    trainer, inference, advantages, mask = map(list, zip(*tokens))
    seq = [i // 3 for i in range(len(tokens))]
    g, out = grad(loss_fn, trainer, inference, advantages, mask, seq)
    assert torch.isfinite(out.loss)
    for value, is_loss_token in zip(g.tolist(), mask):
        if not is_loss_token:
            assert value == 0.0
