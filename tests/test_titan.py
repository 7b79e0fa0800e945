"""torchtitan: config validation, the CPU refusal through the CLI, and torchtitan 0.3.0's spec, model and
state-dict adapter for real on CPU (forward only: torchtitan's flex attention has no CPU backward).

Tests that need torchtitan skip where it is not importable, unless ``I3CORE_REQUIRE_TITAN=1`` (CI sets it,
running this file with its titan environment's interpreter) turns the skip into a failure. The GPU path
(torchtitan's parallelize function, a training step) is ``benchmarks/bench_titan_gpu.py``.
"""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from i3core.config import validate
from i3core.errors import ConfigError, I3Error
from i3core.plugins.models import titan
from i3core.plugins.models.tiny_moe.tokenizer import VOCAB_SIZE

HAVE_TITAN = all(importlib.util.find_spec(name) for name in ("torchtitan", "triton", "tyro", "spmd_types"))


@pytest.fixture
def needs_titan():
    if not HAVE_TITAN:
        reason = "torchtitan 0.3.0 is not importable (pip install 'i3core[titan]')"
        if os.environ.get("I3CORE_REQUIRE_TITAN") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def tiny(**options) -> titan.TitanConfig:
    """Qwen3 ``debugmodel_moe`` cut to one block: 39.5M parameters, a CPU forward in well under a second."""
    return titan.TitanConfig(**{"n_layers": 1, **options})


def weights(model: titan.TitanPolicy) -> dict[str, torch.Tensor]:
    """The state dict less its buffers (the router's load-balancing bias is not a weight HF stores)."""
    buffers = {name for name, _ in model.decoder.named_buffers()}
    return {k: v for k, v in model.decoder.state_dict().items() if k not in buffers}


def write_config(tmp_path, model: str) -> str:
    path = tmp_path / "plugins.toml"
    path.write_text(f'[run]\nname = "t"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 1\n\n[model]\n{model}\n'
                    '[inference]\nuse = "builtin"\n\n[env]\nuse = "arithmetic"\n')
    return str(path)


def cli(*args: str, block_titan: bool = False) -> subprocess.CompletedProcess:
    """``i3core ARGS`` in a subprocess of this interpreter; ``block_titan`` hides torchtitan as if not installed."""
    prelude = "import sys; sys.modules['torchtitan'] = None; " if block_titan else "import sys; "
    code = prelude + "from i3core.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


# -- without torchtitan, and on CPU ------------------------------------------------


def test_without_the_extra_the_config_gets_one_install_line(tmp_path):
    result = cli("check", write_config(tmp_path, 'use = "torchtitan"'), block_titan=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: model torchtitan needs torchtitan 0.3.0 (torchtitan is missing): pip install 'i3core[titan]'"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.slow
def test_run_on_cpu_refuses_with_one_line_naming_tiny_moe(tmp_path, needs_titan):
    result = cli("run", write_config(tmp_path, 'use = "torchtitan"\nn_layers = 1'))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()  # log lines (the run starts and ends as failed), then the error
    assert lines[-1] == f"error: {titan.CPU_REFUSAL}"
    assert [line for line in lines if "error" in line.lower()] == [lines[-1]], lines
    assert "tiny-moe" in titan.CPU_REFUSAL and "Traceback" not in result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_component_refuses_on_cpu(needs_titan):
    with pytest.raises(I3Error, match="needs a CUDA GPU.*tiny-moe"):
        titan.TorchTitan(tiny()).build()


@pytest.mark.slow
def test_check_validates_without_building(tmp_path, needs_titan):
    """``check`` builds nothing, so a GPU config checks OK on a laptop; ``run`` is what refuses."""
    result = cli("check", write_config(tmp_path, 'use = "torchtitan"\nfamily = "deepseek_v3"\nflavor = "16B"'))
    assert result.returncode == 0, result.stderr
    assert "model=torchtitan" in result.stdout


# -- config validation -----------------------------------------------------------


def test_config_problems_are_reported_with_their_keys(builtins, needs_titan):
    with pytest.raises(ConfigError) as info:
        validate({"model": {"use": "torchtitan", "flavour": "30B-A3B", "attn_backend": "sdpa"}}, builtins)
    text = str(info.value)
    assert "model.flavour" in text and "did you mean 'flavor'" in text
    assert "model.attn_backend" in text


@pytest.mark.parametrize(("options", "message"), [
    ({"flavor": "30B-A3", "family": "qwen3"}, "unknown qwen3 flavor '30B-A3' (did you mean '30B-A3B'?)"),
    ({"flavor": "8B"}, "MoE flavors: debugmodel_moe, 30B-A3B, 235B-A22B"),
    ({"family": "deepseek_v3", "flavor": "debugmodel_moe"}, "MoE flavors: debugmodel, 16B, 236B, 671B"),
    ({"n_layers": 9}, "n_layers (9) exceeds the 8 layers of debugmodel_moe"),
    ({"n_layers": 0}, "greater than or equal to 1"),
    ({"family": "deepseek_v3", "flavor": "debugmodel", "n_layers": 1}, "keep at least one MoE layer"),
])
def test_bad_flavors_and_overrides_are_refused(builtins, needs_titan, options, message):
    with pytest.raises(ConfigError, match="model") as info:
        validate({"model": {"use": "torchtitan", **options}}, builtins)
    assert message in str(info.value)


def test_init_from_and_tokenizer_are_checked_with_the_config(tmp_path, builtins, needs_titan):
    """Where the weights and tokenizer come from is checked by ``check`` (on a laptop), not on the GPU host."""
    def refused(**options):
        with pytest.raises(ConfigError) as info:
            validate({"model": {"use": "torchtitan", **options}}, builtins)
        return str(info.value)

    assert f"model.init_from: {tmp_path / 'nope'} is not a directory" in refused(init_from=str(tmp_path / "nope"))
    assert "has no config.json" in refused(init_from=str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert "has no model.safetensors (nor its index)" in refused(init_from=str(tmp_path))
    assert "model.tokenizer: " in refused(tokenizer=str(tmp_path))
    assert "has no tokenizer.json" in refused(tokenizer=str(tmp_path))
    titan.save_hf_dir(titan.build_model(tiny(), VOCAB_SIZE, "cpu"), tmp_path, None)
    config = titan.TitanConfig(init_from=os.path.relpath(tmp_path), tokenizer=os.path.relpath(tmp_path))
    assert config.init_from == config.tokenizer == tmp_path.resolve()  # every role reads the same directory


def test_good_config_resolves_to_torchtitans_spec(needs_titan):
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    spec = titan.model_spec(titan.TitanConfig(flavor="30B-A3B", n_layers=4), VOCAB_SIZE)
    assert (spec.name, spec.flavor) == ("qwen3", "30B-A3B")
    assert isinstance(spec.model, Qwen3Model.Config)
    assert spec.parallelize_fn is parallelize_qwen3 and spec.state_dict_adapter is Qwen3StateDictAdapter
    assert len(spec.model.layers) == 4 and spec.model.dim == 2048
    assert spec.model.vocab_size == spec.model.lm_head.out_features == VOCAB_SIZE
    moe = spec.model.layers[0].moe
    assert (moe.num_experts, moe.router.top_k, moe.routed_experts.inner_experts.hidden_dim) == (128, 8, 768)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(needs_titan):
    with pytest.raises(I3Error, match=r"model.vocab_size \(100\) is smaller than the tokenizer's 260 tokens"):
        titan.model_spec(tiny(vocab_size=100), VOCAB_SIZE)


def test_deepseek_spec_and_parallelize_signature(needs_titan):
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    spec = titan.model_spec(titan.TitanConfig(family="deepseek_v3", flavor="16B", vocab_size=102400), 0)
    assert spec.name == "deepseek_v3" and spec.parallelize_fn is parallelize_deepseekv3
    assert spec.model.vocab_size == 102400 and len(spec.model.layers) == 27
    wanted = {"parallel_dims", "training", "parallelism", "compile_config", "ac_config", "dump_folder"}
    for fn in (spec.parallelize_fn, titan.model_spec(tiny(), 0).parallelize_fn):
        assert wanted <= set(inspect.signature(fn).parameters), fn


# -- models built from the config -----------------------------------------------------


def test_full_flavor_on_meta_has_its_published_size(needs_titan):
    spec = titan.model_spec(titan.TitanConfig(flavor="30B-A3B"), 151936)
    with torch.device("meta"):
        decoder = spec.model.build()
    assert round(titan.num_parameters(decoder) / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5B parameters


def test_tiny_cpu_model_has_the_expected_parameter_count(needs_titan):
    model = titan.build_model(tiny(n_layers=2), VOCAB_SIZE, "cpu", seed=0)
    dim, heads, kv, head, experts, hidden = 256, 16, 8, 128, 64, 768
    attention = dim * heads * head * 2 + dim * kv * head * 2 + 2 * head
    block = attention + experts * 3 * dim * hidden + experts * dim + 2 * dim
    assert titan.num_parameters(model) == 2 * VOCAB_SIZE * dim + dim + 2 * block


@pytest.mark.slow
def test_forward_gives_hidden_states_and_respects_packing(needs_titan):
    model = titan.build_model(tiny(), VOCAB_SIZE, "cpu", seed=0).eval()
    a, b = torch.randint(0, VOCAB_SIZE, (1, 12)), torch.randint(0, VOCAB_SIZE, (1, 20))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(12), torch.arange(20)])[None]
    with torch.no_grad():
        hidden = model(packed, positions)
        alone = model(b, torch.arange(20)[None])
    assert hidden.shape == (1, 32, 256) and model.logits(hidden).shape == (1, 32, VOCAB_SIZE)
    assert torch.allclose(hidden[:, 12:], alone, atol=1e-5)  # the second sample never sees the first


def test_seeded_builds_are_reproducible(needs_titan):
    one, two = (titan.build_model(tiny(), VOCAB_SIZE, "cpu", seed=3) for _ in range(2))
    other = titan.build_model(tiny(), VOCAB_SIZE, "cpu", seed=4)
    first = one.decoder.state_dict()
    assert all(torch.equal(first[k], v) for k, v in two.decoder.state_dict().items())
    wo = "layers.0.attention.wo.weight"
    assert not torch.equal(first[wo], other.decoder.state_dict()[wo])


PARALLELIZE_ON_CPU = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
import torchtitan.distributed.parallel_dims as parallel_dims
parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on CUDA only; gloo on CPU runs the same code
from i3core.plugins.models import titan
cfg = titan.TitanConfig(n_layers=2, activation_checkpointing=sys.argv[1], param_dtype="float32")
model = titan.build_model(cfg, 260, "cpu", seed=0)
ids = torch.randint(0, 260, (2, 16))
with torch.no_grad():
    before = model.logits(model(ids))
hf_before = dict(titan.iter_hf_tensors(model))
titan.parallelize_model(model, cfg, world=1, checkpoint=True, seq_len=64)
with torch.no_grad():
    after = model.logits(model(ids))
hf_after = dict(titan.iter_hf_tensors(model))
print(type(model.decoder).__name__, type(model.decoder.layers["0"]).__name__, type(next(model.parameters())).__name__)
print(torch.equal(before, after), sorted(hf_after) == sorted(hf_before),
      all(torch.equal(hf_after[k], hf_before[k]) for k in hf_before))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "port"), [("selective", "29541"), ("full", "29542")])
def test_parallelize_applies_torchtitans_ac_and_fsdp2(mode, port, needs_titan):
    """torchtitan's parallelize function on a one-rank gloo group: blocks checkpoint-wrapped, the decoder
    FSDP2-sharded (DTensor parameters), the same logits, and ``to_hf`` over the shards gives the same tensors."""
    result = subprocess.run([sys.executable, "-c", PARALLELIZE_ON_CPU, mode, port], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["FSDPQwen3Model", "FSDPCheckpointWrapper", "DTensor", "True", "True", "True"]


# -- HF layout through torchtitan's state-dict adapter -------------------------------


def test_to_hf_names_and_shapes(needs_titan):
    model = titan.build_model(tiny(), VOCAB_SIZE, "cpu")
    tensors = dict(titan.iter_hf_tensors(model))
    assert tensors["model.embed_tokens.weight"].shape == (VOCAB_SIZE, 256)
    assert tensors["lm_head.weight"].shape == (VOCAB_SIZE, 256)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (2048, 256)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (1024, 256)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (64, 256)
    for e in (0, 63):
        assert tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"].shape == (768, 256)
        assert tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].shape == (768, 256)
        assert tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].shape == (256, 768)
    assert len(tensors) == 2 + 1 + 6 + 2 + 1 + 64 * 3  # embed/head, final norm, attention, norms, router, experts
    w1 = model.decoder.layers["0"].moe.routed_experts.inner_experts.w1_EFD
    assert torch.equal(tensors["model.layers.0.mlp.experts.5.gate_proj.weight"], w1[5])


def test_to_hf_from_hf_round_trip_values(needs_titan):
    model = titan.build_model(tiny(), VOCAB_SIZE, "cpu", seed=1)
    adapter = model.spec.state_dict_adapter(model.cfg, None)
    state = weights(model)
    back = adapter.from_hf(adapter.to_hf(dict(state)))
    assert set(back) == set(state)
    for name, value in state.items():
        assert torch.equal(back[name], value), name


def test_save_hf_then_init_from_restores_every_weight(tmp_path, needs_titan):
    model = titan.build_model(tiny(), VOCAB_SIZE, "cpu", seed=1)
    titan.save_hf_dir(model, tmp_path, None)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert (tmp_path / "tokenizer.json").exists()
    again = titan.build_model(tiny(init_from=tmp_path), VOCAB_SIZE, "cpu", seed=2)
    restored = weights(again)
    for name, value in weights(model).items():
        assert torch.equal(restored[name], value), name


def test_init_from_a_mismatched_checkpoint_is_one_clear_error(tmp_path, needs_titan):
    titan.save_hf_dir(titan.build_model(tiny(n_layers=2), VOCAB_SIZE, "cpu"), tmp_path, None)
    with pytest.raises(I3Error, match="does not fit qwen3 debugmodel_moe: missing.*unexpected .'layers.1"):
        titan.build_model(tiny(init_from=tmp_path), VOCAB_SIZE, "cpu")


def hf_logits_gap(model: titan.TitanPolicy, directory) -> float:
    """Largest |logit| difference between ``model`` and transformers' model of its ``save_hf`` directory."""
    transformers = pytest.importorskip("transformers")
    titan.save_hf_dir(model, directory, None)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB_SIZE, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model.logits(model(ids)) - reference(input_ids=ids).logits).abs().max().item()


@pytest.mark.slow
def test_qwen3_save_hf_matches_transformers_logits(tmp_path, needs_titan):
    model = titan.build_model(tiny(n_layers=2), VOCAB_SIZE, "cpu", seed=5).eval()
    assert hf_logits_gap(model, tmp_path) < 2e-3  # flex vs eager attention, float32


@pytest.mark.slow
def test_softmax_deepseek_is_deepseek_v2_in_hf_and_round_trips(tmp_path, needs_titan):
    """``debugmodel`` routes with a softmax (the DeepSeek-V2 design): transformers' deepseek_v2 computes it."""
    cfg = titan.TitanConfig(family="deepseek_v3", flavor="debugmodel", n_layers=2)
    model = titan.build_model(cfg, VOCAB_SIZE, "cpu", seed=1).eval()
    assert hf_logits_gap(model, tmp_path) < 1e-3
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert (hf_config["model_type"], hf_config["first_k_dense_replace"], hf_config["n_routed_experts"],
            hf_config["topk_method"]) == ("deepseek_v2", 1, 8, "greedy")
    again = titan.build_model(cfg.model_copy(update={"init_from": tmp_path}), VOCAB_SIZE, "cpu", seed=2)
    restored = weights(again)
    for name, value in weights(model).items():
        assert torch.equal(restored[name], value), name


@pytest.mark.slow
def test_sigmoid_deepseek_is_deepseek_v3_in_hf(tmp_path, needs_titan, monkeypatch):
    """671B's router (sigmoid, group-limited, renormalised, scaled, with a bias) on the debug model's shapes."""
    resolve = titan.model_spec

    def sigmoid_router(cfg, vocab_size):
        spec = resolve(cfg, vocab_size)
        for layer in spec.model.layers:
            if layer.moe is not None:
                router = layer.moe.router
                router.score_func, router.route_norm, router.route_scale = "sigmoid", True, 2.5
                router.num_expert_groups, router.num_limited_groups = 4, 2
        return spec

    monkeypatch.setattr(titan, "model_spec", sigmoid_router)
    model = titan.build_model(titan.TitanConfig(family="deepseek_v3", flavor="debugmodel", n_layers=3),
                              VOCAB_SIZE, "cpu", seed=1).eval()
    with torch.no_grad():
        for layer in list(model.decoder.layers.values())[1:]:
            layer.moe.expert_bias_E.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    assert hf_logits_gap(model, tmp_path) < 1e-3
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert (hf_config["model_type"], hf_config["topk_method"], hf_config["n_group"]) == ("deepseek_v3", "noaux_tc", 4)


# -- i3core's trainer on the torchtitan model -------------------------------------------

TRAINER_SCRIPT = Path(__file__).resolve().parent / "titan_cpu_trainer.py"


def trainer_run(tmp_path, ranks: int) -> tuple[dict, dict]:
    """One trainer step of the torchtitan model under torchrun on ``ranks`` gloo ranks (see titan_cpu_trainer.py):
    (its metrics, the HF tensors it published as version 1)."""
    from safetensors.torch import load_file

    from i3core.loop.packing import Sample, pack

    out = tmp_path / f"ranks{ranks}"
    (out / "batches").mkdir(parents=True)
    config = out / "plugins.toml"
    config.write_text(f'[run]\nname = "t"\noutput_dir = "{out}"\nmax_steps = 1\n\n'
                      '[trainer]\nseq_len = 64\nmicro_batch_rows = 1\nactivation_memory = "checkpoint"\n\n'
                      '[model]\nuse = "torchtitan"\nn_layers = 1\nparam_dtype = "float32"\n'
                      'activation_checkpointing = "selective"\n\n[env]\nuse = "arithmetic"\n\n[loss]\nuse = "icepop"\n\n'
                      '[optimizer]\nuse = "adamw"\nlr = 0.01\n\n[weight_sync]\nuse = "filesystem"\n')
    rng = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate((40, 30, 24, 20, 16, 12)):
        ids = torch.randint(0, VOCAB_SIZE, (n,), generator=rng).tolist()
        samples.append(Sample(ids, [False] * 4 + [True] * (n - 4), [-5.5] * n, [0] * n, 1.0 if i % 2 else -1.0))
    torch.save(pack(samples, 64), out / "batches" / "step_1.pt")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(TRAINER_SCRIPT), str(config)],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    metrics = json.loads((out / "trainer" / "step_1.json").read_text())
    published = load_file(str(next(out.glob("broadcasts/*1/model.safetensors"))))
    return metrics, published


@pytest.mark.slow
def test_trainer_step_on_two_sharded_ranks_matches_one_process(tmp_path, needs_titan):
    """The real trainer path with torchtitan's AC and FSDP2 (see titan_cpu_trainer.py for the CPU stand-ins):
    the step on two gloo ranks publishes the same weights as on one, and they moved."""
    one, published_one = trainer_run(tmp_path, 1)
    two, published_two = trainer_run(tmp_path, 2)
    initial = dict(titan.iter_hf_tensors(titan.build_model(tiny(param_dtype="float32"), VOCAB_SIZE, "cpu", seed=0)))
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-4) and one["grad_norm"] > 0
    assert set(published_one) == set(published_two) == set(initial)
    for name, value in published_one.items():
        assert torch.allclose(value, published_two[name], atol=1e-5), name
    assert not torch.equal(published_one["model.layers.0.mlp.experts.0.gate_proj.weight"],
                           initial["model.layers.0.mlp.experts.0.gate_proj.weight"])


# -- the GPU check script ---------------------------------------------------------------

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_titan_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's refusal on machines without CUDA")
def test_gpu_bench_refuses_without_cuda_in_one_line():
    result = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: bench_titan_gpu needs a CUDA GPU (none is visible); it was not run"]


def test_gpu_bench_configs_validate(tmp_path, needs_titan):
    from i3core.config import load_config

    spec = importlib.util.spec_from_file_location("bench_titan_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for family, flavor in bench.FAMILIES.items():
        config, _ = load_config(bench.write_config(family, flavor, tmp_path, 2048))
        assert (config.get("model").name, config.get("model").config.flavor) == ("torchtitan", flavor)
        assert config.trainer.activation_memory == "checkpoint"
