"""Run under torchrun by tests/test_titan.py: i3core's trainer (``i3core.loop.trainer.main``) on the torchtitan model,
on CPU, with four stand-ins that exist only here, each for a GPU-only piece of torchtitan 0.3.0:

- ``train_device`` gives the CPU instead of refusing (the model component refuses CPU on purpose);
- torchtitan's meshes use the ``cpu`` device type (it hard-codes CUDA when no accelerator is found), so
  FSDP2 runs over gloo;
- FSDP2's gradient reduce-scatter sums and then divides (gloo has no ``PREMUL_SUM``, which FSDP2 picks for
  torchtitan's float32 reduce dtype; NCCL has it);
- flex attention (no CPU backward) is replaced by scaled-dot-product attention under the same block mask
  (``create_mask`` of the BlockMask's ``mask_mod``), checked equal to flex attention's forward first.

Everything else is the production path: the component's build, torchtitan's parallelize function (AC, FSDP2),
the trainer's step, the filesystem weight push through torchtitan's ``to_hf``, the checkpoint.
Usage: ``torchrun --nproc-per-node N tests/titan_cpu_trainer.py plugins.toml``.
"""

import sys

import torch
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as parallel_dims
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import create_mask
from torchtitan.models.common.attention import FlexAttention

from i3core.loop import trainer
from i3core.plugins.models import titan


class _NoAux:
    lse = None


def dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """Flex attention's result for a mask-only BlockMask, by SDPA on the dense mask ``[B, 1, L, S]``."""
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), _NoAux()


def check_stand_in() -> None:
    model = titan.build_model(titan.TitanConfig(n_layers=1), 260, "cpu", seed=0)
    ids = torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    with torch.no_grad():
        flex = model(ids, positions)
        original, FlexAttention._compiled_flex_attn = FlexAttention._compiled_flex_attn, staticmethod(dense_attention)
        dense = model(ids, positions)
    assert torch.allclose(flex, dense, atol=1e-3), (flex - dense).abs().max()  # float32 summation order


def parallelize_for_gloo(model, *args, **kwargs) -> None:
    parallelize(model, *args, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


parallelize = titan.parallelize_model

if __name__ == "__main__":
    titan.train_device = lambda: torch.device("cpu")
    titan.parallelize_model = parallelize_for_gloo
    parallel_dims.device_type = "cpu"
    check_stand_in()
    sys.exit(trainer.main(sys.argv[1:]))
