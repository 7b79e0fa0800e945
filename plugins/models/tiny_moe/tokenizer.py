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


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` reads."""
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_id(token: str) -> int:
    return 256 + SPECIAL_TOKENS.index(token)
