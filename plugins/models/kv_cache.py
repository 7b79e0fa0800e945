"""How the builtin engine's KV caches grow (tiny-moe's and ``hf``'s): each layer's ``[slots, kv_heads, capacity,
head_dim]`` holds room for the longest position written so far, not for ``max_len`` from the start, so an engine
sized for long sequences (``inference.max_len``) holds the memory of the ones it has seen."""

import torch

KV_MIN_CAPACITY = 32
"""Positions a KV cache makes room for at its first write (the quickstart's sequences are about 20 tokens)."""


def reserved(cache: torch.Tensor, length: int, max_len: int) -> torch.Tensor:
    """``cache`` ``[slots, heads, capacity, D]`` with room for positions ``0..length-1``: itself when it has it, else
    copied into a zeroed one of the next capacity (:func:`grown`)."""
    capacity = cache.shape[2]
    if length <= capacity:
        return cache
    wider = cache.new_zeros(*cache.shape[:2], grown(capacity, length, max_len), cache.shape[3])
    wider[:, :, :capacity] = cache
    return wider


def grown(capacity: int, length: int, max_len: int) -> int:
    """A cache's next capacity for ``length`` positions: at least double the last (a sequence growing token by token
    copies the cache a logarithmic number of times), never past ``max_len``."""
    return min(max_len, max(length, 2 * capacity, KV_MIN_CAPACITY))
