import torch

from i3core.types import LossInputs


def test_hook_i3_register_losses(i3_plugins):
    component = i3_plugins.registry.get("loss", "reinforce")
    assert component.provider.distribution == "i3-plugin-example"


def test_hook_i3_register_envs(i3_make_component):
    env = i3_make_component("env", "count-letters", num_examples=5, seed=1)
    example = env.examples()[0]
    assert env.score(env.demonstration(example), example) == 1.0
    assert env.score("wrong", example) == 0.0


def test_reinforce_gradient(i3_make_component):
    loss_fn = i3_make_component("loss", "reinforce")
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=logp,
        inference_logprobs=logp.detach(),
        advantages=torch.tensor([2.0, 2.0, 2.0]),
        loss_mask=torch.tensor([True, False, True]),
        sequence_ids=torch.tensor([0, 0, 0]),
    )
    loss_fn(inputs).loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.0, 0.0, -1.0]))
