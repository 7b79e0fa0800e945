"""What the trainer measures about itself: the machine's matmul peak (for MFU) and activation memory."""

import time

import torch


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024,
                      seconds: float = 0.3) -> float:
    """The best FLOP/s of a square ``size`` matmul on ``device`` over about ``seconds``: the peak MFU is taken against.

    Measured in the same process and with the same thread count as training, so model FLOPs
    utilisation compares like with like on a CPU (where no spec sheet applies).
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2 * size**3
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, flops / (time.perf_counter() - start))
        if time.perf_counter() > deadline:
            return best


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks around a forward: count the bytes of activations kept for backward, and with
    ``offload`` keep them in host memory until backward needs them (INTELLECT-3's first memory lever).

    Parameters saved by matmuls are not activations and are left alone. On a CPU the activations
    already live in host memory: offloading moves nothing there, it only runs the same path.
    """

    def __init__(self, model: torch.nn.Module, offload: bool = False):
        self.params = {_storage_key(p) for p in model.parameters()}
        self.offload = offload
        self.bytes = 0
        self._seen: set[int] = set()
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivations":
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key is None or key in self.params or isinstance(tensor, torch.nn.Parameter) \
                or isinstance(tensor._base, torch.nn.Parameter):
            return tensor  # a weight (FSDP2's unsharded ones are Parameters too), not an activation
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        if self.offload and tensor.device.type != "cpu":
            return tensor.device, tensor.to("cpu", non_blocking=True)
        return tensor

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            device, tensor = packed
            return tensor.to(device, non_blocking=True)
        return packed


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (its local shard's for a DTensor); None when it has none."""
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if callable(to_local) else tensor
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # FSDP2 frees and resizes unsharded storages
        return None
