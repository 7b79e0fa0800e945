"""The vLLM worker extension (``--worker-extension-cls``): weight updates inside each vLLM worker.

vLLM mixes this class into its Worker; the API server reaches its methods with
``collective_rpc``. Method names carry an ``i3_`` prefix so none clashes with
the Worker's own (``update_weights``, ``reload_weights``...).

An update is checked before anything is applied: every HF tensor name and
shape must match the checkpoint the server started from (a reload that fails
midway would take the engine down). Then ``reload_weights`` copies the tensors
in place; on the CPU backend the MoE experts are re-packed afterwards (its
grouped-GEMM kernels keep experts in a packed layout that a reload does not
restore). Every call returns how many tokens each running request has produced,
so the API server can tag tokens with versions exactly.
"""

from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file


class WeightUpdateExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker."""

    def i3_token_counts(self) -> dict[str, int]:
        """Tokens generated so far per request the model runner holds (engine-internal request ids)."""
        return {rid: len(state.output_token_ids) for rid, state in self.model_runner.requests.items()}

    def i3_load_path(self, path: str) -> dict:
        """Load ``path/model.safetensors`` (HF layout) into the running model."""
        weights = Path(path) / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"no model.safetensors under {path}")
        return {"version": None, "counts": self._i3_apply(load_file(str(weights)))}

    def i3_receive(self, spec: dict, rank: int) -> dict:
        """Take the next broadcast version from the weight-sync group (joined on first use)."""
        receiver = getattr(self, "_i3_receiver", None)
        if receiver is None:
            from i3core.weights import connect_receiver

            receiver = self._i3_receiver = connect_receiver(spec, rank)
        version, tensors = receiver.receive()
        return {"version": version, "counts": self._i3_apply(tensors)}

    # -- applying ----------------------------------------------------------------

    def _i3_expected(self) -> dict[str, tuple[int, ...]]:
        expected = getattr(self, "_i3_shapes", None)
        if expected is None:
            expected = {}
            for file in sorted(Path(self.vllm_config.model_config.model).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        expected[name] = tuple(handle.get_slice(name).get_shape())
            self._i3_shapes = expected
        return expected

    def _i3_check(self, tensors: dict) -> None:
        expected = self._i3_expected()
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
        if missing or unexpected or wrong:
            raise ValueError(f"HF weights do not fit the served model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")

    def _i3_apply(self, tensors: dict) -> dict[str, int]:
        self._i3_check(tensors)
        dtype = self.vllm_config.model_config.dtype
        self.reload_weights(weights_iterator=((n, t.to(dtype)) for n, t in tensors.items()))
        layers = getattr(self, "_i3_packed", None)
        if layers is None:
            layers = self._i3_packed = _cpu_expert_layers(self.model_runner.model)
        _repack(layers)
        return self.i3_token_counts()


def _cpu_expert_layers(model) -> list[tuple[object, str]]:
    """``(layer, isa)`` of every MoE layer the CPU backend packs (none off the CPU build)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    layers = []
    for module in model.modules():
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight"):
            experts = _find(module, CPUUnquantizedExperts)
            if experts is not None:
                layers.append((module, experts.isa))
    return layers


def _repack(layers: list[tuple[object, str]]) -> None:
    """Put reloaded experts back into the CPU kernels' packed layout, in place."""
    if not layers:
        return
    from vllm._custom_ops import cpu_prepack_moe_weight

    for layer, isa in layers:
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, isa))


def _find(root, cls, depth: int = 5):
    """The first object of type ``cls`` reachable from ``root``'s attributes (vLLM nests its MoE kernels)."""
    seen, frontier = set(), [root]
    for _ in range(depth):
        following = []
        for obj in frontier:
            if isinstance(obj, cls):
                return obj
            if id(obj) in seen or not hasattr(obj, "__dict__"):
                continue
            seen.add(id(obj))
            for value in vars(obj).values():
                for item in value.values() if isinstance(value, dict) else (value,):  # nn.Module keeps _modules
                    if hasattr(item, "__dict__") and not isinstance(item, type):
                        following.append(item)
        frontier = following
    return None
