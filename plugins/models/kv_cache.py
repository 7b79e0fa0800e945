"""How the builtin engine's KV caches grow (tiny-moe's and ``hf``'s): each layer's ``[slots, kv_heads, capacity,
head_dim]`` holds room for the longest position written so far, not for ``max_len`` from the start, so an engine
sized for long sequences (``inference.max_len``) holds the memory of the ones it has seen."""

import torch

KV_MIN_CAPACITY = 32
"""Positions a KV cache makes room for at its first write (the quickstart's sequences are about 20 tokens)."""


def grown(capacity: int, length: int, max_len: int) -> int:
    """A cache's next capacity for ``length`` positions: at least double the last (a sequence growing token by token
    copies the cache a logarithmic number of times), never past ``max_len``."""
    return min(max_len, max(length, 2 * capacity, KV_MIN_CAPACITY))


def widened(cache: torch.Tensor, size: int) -> torch.Tensor:
    """``cache`` ``[slots, heads, capacity, D]`` copied into a zeroed ``[slots, heads, size, D]``."""
    wider = cache.new_zeros(*cache.shape[:2], size, cache.shape[3])
    wider[:, :, : cache.shape[2]] = cache
    return wider
