"""A model plugin that fails on purpose, and the builtin server process over it.

``faulty`` is tiny-moe whose cached forward writes NaN into the hidden state and the KV cache of every row whose
prompt holds ``nan_token``, as a diverged model would (a fault that belongs to one sequence) and raises on its ``raise_at``-th call (a fault
that breaks the engine). Run as a script, this file is ``python -m i3core.plugins.inference.server`` with the
plugin registered: ``python tests/faulty_server.py --model-dir DIR --model faulty --model-options JSON``.
"""

import itertools
import math
import sys

from i3core import hookimpl
from i3core.plugins.models.tiny_moe import TinyMoE


class Faulty(TinyMoE):
    class Config(TinyMoE.Config):
        nan_token: int = -1
        """Prefilled rows holding this token get NaN hidden states (so NaN logits) and a NaN KV cache; -1: none."""
        raise_at: int = 0
        """The cached forward raises on this call (1: the first); 0: never."""

    def load_hf(self, path):
        model = super().load_hf(path)
        forward_cached, calls = model.forward_cached, itertools.count(1)
        nan_token, raise_at = self.config.nan_token, self.config.raise_at

        def faulty_forward_cached(tokens, positions, cache, slots):
            if next(calls) == raise_at:
                raise RuntimeError("injected fault: the forward failed")
            hidden = forward_cached(tokens, positions, cache, slots)
            poisoned = (tokens == nan_token).any(-1) & (tokens.shape[-1] > 1)  # a prompt, not a sampled token
            if bool(poisoned.any()):
                hidden = hidden.clone()
                hidden[poisoned] = math.nan
                for layer in (*cache.keys, *cache.values):
                    layer[slots[poisoned]] = math.nan
            return hidden

        model.forward_cached = faulty_forward_cached
        return model


class FaultyPlugin:
    @hookimpl
    def i3_register_models(self, register):
        register("faulty", Faulty)


if __name__ == "__main__":
    from i3core.plugins.inference import server
    from i3core.testing import plugin_manager

    server.load_plugins = lambda: plugin_manager(FaultyPlugin(), installed=False)
    server.main(sys.argv[1:])
