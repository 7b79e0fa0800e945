"""A Qwen3-MoE-architecture causal LM in plain torch, with experts stored stacked ``[E, ...]``.

Shapes: ``B`` rows, ``S`` tokens a row, ``H`` hidden size, ``E`` experts, ``k``
experts per token, ``I`` expert intermediate size, ``V`` vocabulary.

Differences from the textbook transformer, all as in Qwen3-MoE: RMSNorm before
attention and MLP, RMSNorm on each head of q and k (qk-norm), rotary position
embeddings, grouped-query attention, and a softmax top-k router over experts
whose top-k weights are renormalised (``norm_topk_prob``). Packed rows hold
several samples; attention never crosses a sample, whose start is where its
``position_ids`` restart at 0, and a sample may be a prefix tree (completions sharing
one copy of their prompt): :mod:`i3core.packed` reads the layout.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from i3core.packed import attention_mask
from i3core.plugins.models.kv_cache import reserved


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``(cos, sin)``, each ``[B, S, head_dim]``, for rotary embeddings at ``position_ids`` ``[B, S]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, heads, S, D]``; ``cos``/``sin`` ``[B, S, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    def forward_cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        read: "CacheRead",
    ) -> torch.Tensor:
        """Attention of new tokens against a KV cache, writing their keys/values into it.

        ``x`` ``[B, S, H]`` are the new tokens of ``B`` sequences held in cache
        ``slots`` ``[B]`` at ``positions`` ``[B, S]``; ``cache_k``/``cache_v`` are
        ``[slots, kv_heads, max_len, D]``. Token (b, s) attends to cache entries
        ``0..positions[b, s]`` of its own slot (``read``: which entries are read and the mask).

        Grouped-query attention without repeating keys and values per query head: the ``heads // kv_heads``
        query heads of a kv head are stacked as rows of one batched matmul against that head's keys.
        """
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache_k[slots[:, None], :, positions] = k.transpose(1, 2)
        cache_v[slots[:, None], :, positions] = v.transpose(1, 2)
        keys, values = read.gather(cache_k), read.gather(cache_v)  # [B, kv_heads, L, D]
        rows = b * self.kv_heads
        group = q.reshape(rows, (self.heads // self.kv_heads) * s, self.head_dim)
        scores = torch.baddbmm(read.bias, group, keys.reshape(rows, read.length, self.head_dim).transpose(1, 2),
                               alpha=1.0 / math.sqrt(self.head_dim))
        out = torch.bmm(scores.softmax(-1), values.reshape(rows, read.length, self.head_dim))
        out = out.view(b, self.heads, s, self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class CacheRead:
    """What every layer of one :meth:`TinyMoEModel.forward_cached` call reads from its cache: the first
    ``length`` entries (the longest live position + 1) of the ``slots`` (a view when they are consecutive, else a
    gathered copy), and the additive mask ``bias`` ``[B * kv_heads, heads // kv_heads * S, length]`` (0 where token
    (b, s) may attend, -inf elsewhere)."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, kv_heads: int, group: int):
        b, s = positions.shape
        self.length = int(positions.max()) + 1
        first, count = int(slots[0]), slots.shape[0]
        consecutive = bool((slots == torch.arange(first, first + count, device=slots.device)).all())
        self.rows = slice(first, first + count) if consecutive else slots
        hidden = torch.arange(self.length, device=positions.device) > positions[:, :, None]  # [B, S, L]
        bias = torch.zeros(b, 1, 1, s, self.length, device=positions.device).masked_fill_(hidden[:, None, None],
                                                                                            -math.inf)
        self.bias = bias.expand(b, kv_heads, group, s, self.length).reshape(b * kv_heads, group * s, self.length)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """``[B, kv_heads, length, D]`` of a layer's ``[slots, kv_heads, max_len, D]`` cache."""
        if isinstance(self.rows, slice):
            return cache[self.rows, :, : self.length]
        # the live entries alone (length of max_len), copied contiguous: the attention's reshape reads them as is
        return cache[:, :, : self.length].index_select(0, self.rows)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """grouped_mm's backward rejects broadcast (stride-0) gradients, e.g. from ``.sum()``."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class MoE(nn.Module):
    """Softmax top-k router and stacked SwiGLU experts.

    ``gate_up`` is ``[E, H, 2I]`` (gate columns first, then up), ``down`` is
    ``[E, I, H]``; tokens are sorted by expert so each expert's rows are
    contiguous, then one grouped GEMM per projection runs every expert.
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, norm_topk: bool, backend: str):
        super().__init__()
        self.experts, self.top_k, self.norm_topk, self.intermediate = experts, top_k, norm_topk, intermediate
        self.backend = backend
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, hidden, 2 * intermediate))
        self.down = nn.Parameter(torch.empty(experts, intermediate, hidden))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, H]`` -> (weights ``[N, k]`` in x's dtype, expert indices ``[N, k]``)."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.route(x)
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.experts)
        rows = x[token]
        if self.backend == "grouped_mm":
            out = self._grouped(rows, counts)
        else:
            out = self._loop(rows, counts)
        out = out * weights.reshape(-1)[order, None]
        y = torch.zeros_like(x).index_add_(0, token, out)
        return y.reshape(shape)

    def _swiglu(self, h: torch.Tensor) -> torch.Tensor:
        return F.silu(h[:, : self.intermediate]) * h[:, self.intermediate :]

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        h = _contiguous_grad(torch._grouped_mm(rows, self.gate_up, offs=offs))
        return _contiguous_grad(torch._grouped_mm(self._swiglu(h), self.down, offs=offs))

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(rows.split(counts.tolist())):
            outs.append(self._swiglu(chunk @ self.gate_up[e]) @ self.down[e])
        return torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[-1])


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta
        )
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.norm_topk_prob,
            cfg.expert_backend,
        )

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.moe(self.post_attn_norm(x))

    def forward_cached(self, x, cos, sin, cache_k, cache_v, slots, positions, read):
        x = x + self.attn.forward_cached(self.input_norm(x), cos, sin, cache_k, cache_v, slots, positions, read)
        return x + self.moe(self.post_attn_norm(x))


class KVCache:
    """Keys and values of up to ``slots`` sequences of ``max_len`` tokens, ``[slots, kv_heads, capacity, head_dim]``
    per layer: the capacity grows (doubling, up to ``max_len``) with the longest position written, so an engine
    sized for long sequences holds memory for the ones it has seen
    (:func:`~i3core.plugins.models.kv_cache.grown`)."""

    def __init__(self, cfg, slots: int, max_len: int, dtype: torch.dtype = torch.float32):
        empty = torch.zeros((slots, cfg.num_kv_heads, 0, cfg.head_dim), dtype=dtype)
        self.keys = [empty for _ in range(cfg.num_layers)]
        self.values = [empty for _ in range(cfg.num_layers)]
        self.slots, self.max_len = slots, max_len

    def reserve(self, length: int) -> None:
        """Room for positions ``0..length-1`` in every slot (the entries held so far kept, the new ones zero)."""
        self.keys = [reserved(cache, length, self.max_len) for cache in self.keys]
        self.values = [reserved(cache, length, self.max_len) for cache in self.values]

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor, length: int) -> None:
        """Entries ``0..length-1`` of slots ``source`` ``[B]`` into slots ``target`` ``[B]`` (a shared prompt)."""
        for cache in (*self.keys, *self.values):
            cache[target, :, :length] = cache[source, :, :length]

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zero every entry of ``slots`` ``[B]``: a sequence that failed may have left NaN there, and attention
        reads a slot's entries past its own position (masked, but 0 * NaN is NaN) for its next occupant."""
        for cache in (*self.keys, *self.values):
            cache[slots] = 0


class TinyMoEModel(nn.Module):
    """Embedding, blocks, final norm and LM head; ``forward`` returns hidden states ``[B, S, H]``.

    Logits are left to the caller (``logits`` or a chunked log-softmax) so a
    whole batch's ``[B, S, V]`` float32 logits never need to exist at once.
    """

    def __init__(self, cfg, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.adapter = None
        """The PEFT ``LoraConfig`` of an adapter injected on this (frozen) model, or None."""
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.activation_checkpointing = False
        """Checkpoint every block (set by the trainer's ``activation_memory = "checkpoint"``)."""

    def reset_parameters(self, seed: int) -> None:
        """Initialise every weight from ``seed`` (normal(0, init_std); norms at 1)."""
        generator = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        cos, sin = rotary(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        mask = attention_mask(position_ids)  # packed samples apart, prefix trees shared (i3core.packed)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only each block's input; recompute its inside in backward (deterministic: same numbers).
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        return self.norm(x)

    def forward_cached(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states ``[B, S, H]`` of new tokens ``input_ids`` ``[B, S]`` of the sequences in ``slots``.

        Used by inference: a prefill passes prompts of one length (``B >= 1``), a decode step
        passes one token for each running sequence (``S = 1``).
        """
        x = self.embed(input_ids)
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        read = CacheRead(slots, positions, self.cfg.num_kv_heads, self.cfg.num_heads // self.cfg.num_kv_heads)
        cache.reserve(read.length)
        for block, keys, values in zip(self.blocks, cache.keys, cache.values):
            x = block.forward_cached(x, cos, sin, keys, values, slots, positions, read)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def new_kv_cache(self, slots: int, max_len: int) -> KVCache:
        """An empty cache of ``slots`` sequences of ``max_len`` tokens, in the weights' dtype."""
        return KVCache(self.cfg, slots, max_len, dtype=next(self.parameters()).dtype)

    def state_dict_from_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-layout ``tensors`` as a state dict of this model's shape (experts stacked), no model built; with an
        adapter, the adapter's tensors (PEFT's names in the HF architecture) as a state of them alone.

        :raises ValueError: a missing, unexpected or wrongly shaped tensor.
        """
        from i3core.plugins.models.tiny_moe.hf import ADAPTER_NAMES, hf_state_dict  # hf builds on this module

        if self.adapter is not None:
            from i3core.plugins.models import lora

            return lora.state_from_files(self, tensors, ADAPTER_NAMES)
        return hf_state_dict(self, tensors)
