"""Build a small Hugging Face causal LM from a config (random weights) and a BPE tokenizer, and save both.

    python examples/make_hf_model.py runs/hf-qwen3              # Qwen3 (dense), the default
    python examples/make_hf_model.py runs/hf-llama --architecture llama
    python examples/make_hf_model.py runs/hf-moe --architecture qwen3_moe

The directory is what ``[model] use = "hf"``, ``path = DIR`` trains (see examples/hf_model.toml): transformers
builds the model from its config.json, ``tokenizers`` trains a byte-level BPE on the text of the tiny envs
(their words, arithmetic, a calculator's tool calls, as multi-line documents; not reverse-text's random strings,
see :func:`corpus`) with ChatML specials and Qwen2's pre-tokenizer (so, as in Qwen's and Llama-3's vocabularies,
``"\n"`` merges with its neighbours: ``":\n"``, ``".\n\n"``, ``"?\n"`` are single tokens), and the tokenizer
carries a ChatML chat template whose turns end with ``<|im_end|>`` (also the eos token). Nothing is downloaded.

Tests import :func:`make_hf_model` to build each architecture.
"""

import argparse
import random
import string
from pathlib import Path

EOS = "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", EOS]
ARCHITECTURES = ("qwen3", "llama", "qwen3_moe")

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (tools and loop.first and m['role'] == 'system') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') -}}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- '\\n<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' + "
    "(args if args is string else (args | tojson)) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with Qwen's tool format (what Qwen3's own template writes for these messages, minus reasoning)."""


QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's (and Qwen3's) pre-tokenizer split: punctuation keeps the newlines after it, newlines stay together."""


def corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Text like the tiny envs' prompts and answers, as multi-line documents, for the BPE's merges: their words,
    numbers and tool calls, but not reverse-text's random letter strings. Merges learned from those (``"cb"``,
    ``" a"``, ``"de"``) cut a string and its reverse into different tokens, and the recipe of
    examples/hf_model.toml then hardly learns: measured on 2026-12-05 (docs/benchmarks.md, bench_quickstart),
    +0.04 reward over 200 steps with such merges and +0.31 without them, everything else equal."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out += ["reverse", f"{a} + {b} = {a + b}.\n\n", f"What is {a} * {b}?\n", f"Answer:\n{a * b}\n",
                '<tool_call>{"name": "calc", "arguments": {"expression": "' + f"{a}*{b}" + '"}}</tool_call>\n']
    out.append(string.printable)
    return out


def build_tokenizer(vocab_size: int = 384, seed: int = 0):
    """A byte-level BPE (every byte is a token, so any text encodes) with ChatML specials and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def model_config(architecture: str, vocab_size: int, eos_id: int, pad_id: int, **overrides):
    """The transformers config of a small ``architecture`` (head_dim 64, as vLLM's CPU attention needs)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=pad_id,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    common = {"intermediate_size": 256, **common, **overrides}
    if architecture == "qwen3":
        return Qwen3Config(**common)
    if architecture == "llama":
        return LlamaConfig(**common)
    if architecture == "qwen3_moe":
        return Qwen3MoeConfig(moe_intermediate_size=128, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, **common)
    raise ValueError(f"architecture must be one of {ARCHITECTURES}, not {architecture!r}")


def make_hf_model(path: str | Path, architecture: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised ``architecture`` model and its tokenizer to ``path``; the directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tokenizer = build_tokenizer(seed=seed)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS), tokenizer.pad_token_id
    config = model_config(architecture, len(tokenizer), eos_id, pad_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id, bos_token_id=eos_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="directory to write (config.json, safetensors, tokenizer)")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="qwen3", help="transformers model type")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the BPE corpus")
    args = parser.parse_args()
    print(make_hf_model(args.path, args.architecture, args.seed))


if __name__ == "__main__":
    main()
