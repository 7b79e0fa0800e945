"""A byte-level tokenizer built with the ``tokenizers`` library: 256 byte tokens plus a few specials.

Nothing is downloaded: the vocabulary is the 256 bytes (in GPT-2's printable
byte-to-unicode mapping, so it round-trips through Hugging Face's ByteLevel
pre-tokenizer and decoder) followed by :data:`SPECIAL_TOKENS`.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer() -> Tokenizer:
    """Token id ``b`` is byte ``b``; specials follow at 256, 257, ..."""
    mapping = byte_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


CHAT_TEMPLATE = (
    "{%- set ns = namespace(messages=messages, offer='', content='') -%}"
    "{%- if tools -%}"
    "{%- set ns.offer = '# Tools\\n<tools>\\n' -%}"
    "{%- for tool in tools -%}{%- set ns.offer = ns.offer + (tool | tojson(sort_keys=True)) + '\\n' -%}{%- endfor -%}"
    "{%- set ns.offer = ns.offer + '</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '\\n\\n' + ns.offer + '<|im_end|>\\n' -}}"
    "{%- set ns.messages = messages[1:] -%}"
    "{%- else -%}{{- '<|im_start|>system\\n' + ns.offer + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- for m in ns.messages -%}"
    "{%- set ns.content = m['content'] or '' -%}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{%- if args is not string -%}{%- set args = args | tojson -%}{%- endif -%}"
    "{%- set ns.content = ns.content + ('\\n' if ns.content else '') + '<tool_call>{\"name\": ' + "
    "(call['function']['name'] | tojson) + ', \"arguments\": ' + (args or '{}') + '}</tool_call>' -%}"
    "{%- endfor -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + ns.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with Qwen's tool format, as a Jinja chat template: what ``TinyMoE.render_chat`` writes, for tokenizers
loaded with ``AutoTokenizer`` (verifiers' renderers, vLLM, transformers)."""


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` reads: the chat template,
    and ``<|im_end|>`` as its eos, the token that ends an assistant turn (as a Qwen3 chat model's tokenizer says:
    chat renderers cut turns there and vLLM stops there)."""
    for name, text in tokenizer_files(tokenizer).items():
        (path / name).write_text(text)


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, str]:
    """What :func:`save_tokenizer` writes: file name -> text."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return {"tokenizer.json": tokenizer.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def token_id(token: str) -> int:
    return 256 + SPECIAL_TOKENS.index(token)
