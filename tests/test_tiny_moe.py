"""tiny-moe: the HF layout both ways (checked against transformers), packing, grouped-MM vs loop."""

import json

import pytest
import torch

from i3core.plugins.models.tiny_moe import hf
from i3core.plugins.models.tiny_moe.tokenizer import EOS, IM_END, build_tokenizer, token_id
from i3core.testing import make_component
from i3core.weights import read_hf_tensors

from .conftest import decode_across_cache_growth

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


@pytest.fixture
def component(builtins):
    return make_component("model", "tiny-moe", plugins=builtins, **SMALL)


def random_ids(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_save_hf_loads_in_transformers_with_matching_logits(component, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = component.build(seed=1)
    component.save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = random_ids(40)
    with torch.no_grad():
        ours = model.logits(model(ids))
        theirs = reference(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_tokenizer_directory_loads_in_transformers(component, tmp_path):
    transformers = pytest.importorskip("transformers")
    component.save_hf(component.build(), tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = build_tokenizer()
    text = "reverse abc: cba" + EOS
    assert tok(text)["input_ids"] == ours.encode(text).ids
    assert tok.decode(ours.encode("héllo").ids) == "héllo"


def test_saved_directory_is_a_chatml_chat_model(component, tmp_path):
    """The template renders ChatML and the turn's end is the eos (what chat renderers cut at, vLLM stops at);
    the component still stops a plain completion at <|endoftext|>, one of generation_config's eos ids."""
    transformers = pytest.importorskip("transformers")
    component.save_hf(component.build(), tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == component.render_chat(messages)
    assert tok.eos_token == IM_END and tok.eos_token_id == token_id(IM_END)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert generation.eos_token_id == [token_id(IM_END), token_id(EOS)]
    assert component.end_of_turn_ids == [token_id(IM_END)] and component.eos_token_id == token_id(EOS)


@pytest.mark.parametrize("layout", ["save_pretrained", "fused"])
def test_init_from_a_transformers_qwen3_moe_directory(builtins, tmp_path, layout):
    """A directory transformers wrote (per-expert tensors, ``num_local_experts``) or holding v5's fused experts
    loads into tiny-moe with transformers' logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    config = transformers.Qwen3MoeConfig(
        vocab_size=260, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, norm_topk_prob=layout == "fused")
    torch.manual_seed(0)
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in reference.parameters():  # the default init leaves norms at 1 and experts tiny
            param.normal_(0, 0.2)
    reference.save_pretrained(tmp_path)
    if layout == "fused":
        (tmp_path / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
        assert "model.layers.0.mlp.experts.gate_up_proj" in reference.state_dict()
    model = make_component("model", "tiny-moe", plugins=builtins, init_from=tmp_path).build()
    assert model.cfg.num_experts == 4 and model.cfg.norm_topk_prob == (layout == "fused")
    ids = random_ids(24, seed=7)
    with torch.no_grad():
        ours = model.logits(model(ids))
        theirs = reference(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_load_hf_roundtrips_exactly(component, tmp_path):
    model = component.build(seed=2)
    component.save_hf(model, tmp_path)
    again = component.load_hf(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    # what the engine swaps in for a version, built without a model: the same names and numbers
    staged = again.state_dict_from_hf(read_hf_tensors(tmp_path))
    assert sorted(staged) == sorted(model.state_dict())
    assert all(torch.equal(staged[name], value) for name, value in model.state_dict().items())


def test_load_hf_rejects_wrong_weights_before_copying(component, tmp_path):
    model = component.build()
    tensors = dict(hf.iter_hf_tensors(model))
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(3, 3)
    before = model.norm.weight.clone()
    with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\].*wrong shape"):
        hf.load_hf_tensors(model, tensors)
    assert torch.equal(before, model.norm.weight)


def test_packed_samples_do_not_attend_to_each_other(component):
    model = component.build(seed=3).eval()
    a, b = random_ids(7, seed=1), random_ids(5, seed=2)
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        together = model(packed, positions)
        alone_a, alone_b = model(a), model(b)
    assert torch.allclose(together[:, :7], alone_a, atol=1e-5)
    assert torch.allclose(together[:, 7:], alone_b, atol=1e-5)


def test_grouped_mm_matches_the_per_expert_loop(builtins):
    grouped = make_component("model", "tiny-moe", plugins=builtins, **SMALL).build(seed=4)
    loop = make_component("model", "tiny-moe", plugins=builtins, expert_backend="loop", **SMALL).build(seed=4)
    ids = random_ids(64, seed=5)
    out_g = grouped.logits(grouped(ids))
    out_l = loop.logits(loop(ids))
    assert torch.allclose(out_g, out_l, atol=1e-5)
    out_g.sum().backward()  # a broadcast gradient: grouped_mm's backward needs it made contiguous
    out_l.sum().backward()
    for (name, pg), (_, pl) in zip(grouped.named_parameters(), loop.named_parameters()):
        assert torch.allclose(pg.grad, pl.grad, atol=1e-5), name


def test_config_checks_shapes(builtins):
    from i3core.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        make_component("model", "tiny-moe", plugins=builtins, num_heads=3, num_kv_heads=2)
    with pytest.raises(ConfigError, match="must not exceed num_experts"):
        make_component("model", "tiny-moe", plugins=builtins, num_experts=2, experts_per_token=3)


def test_the_kv_cache_grows_with_the_positions_written(component):
    """An engine sized for long sequences holds room for the ones written (32 positions, then doubling, at most
    max_len); the cached decode across each growth matches a full forward."""
    model = component.build().eval()
    assert decode_across_cache_growth(model, lambda cache: cache.keys[0].shape[2]) < 1e-5
