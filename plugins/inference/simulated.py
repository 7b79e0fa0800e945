"""Rollout source ``simulated``: servers that take as long as a cluster's would, on a laptop.

The HTTP API, the request queue, continuous batching, in-flight weight
updates and the per-token versions are the builtin server's own
(:class:`~i3core.plugins.inference.server.Server`); only the engine differs.
:class:`SimEngine` produces real token ids and the exact logprobs of the
distribution it sampled them from, but instead of running a network it sleeps
for as long as one decode step would take:

    step_s = (step_base_ms + step_per_seq_ms * running + prefill_per_token_ms * prompt_tokens_admitted) / 1000

so a step slows as the batch grows (memory-bound decode gets compute-bound),
a newly admitted prompt costs its prefill, and a weight update adds
``update_pause_ms`` to the next step. The tokens come from a seeded bigram
table over the tokenizer's vocabulary (perturbed per policy version, so
versions differ); stop tokens are masked from the table, and each sequence
ends on a stop token at a length drawn from a lognormal with median
``length_median`` and log-std ``length_sigma``, redrawn until it falls in
``[length_min, length_max]``. The defaults are INTELLECT-3's 5k-60k token
completions scaled down by 100. A request's ``max_tokens`` and the server's
``max_len`` still cut a sequence short (``finish_reason = "length"``).

Run one: ``python -m i3core.plugins.inference.server --engine simulated --model-dir DIR --timing '{...}'``
(``DIR`` is an HF directory of the run's model: only its ``config.json`` vocabulary size is read).
"""

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import SafetensorError, safe_open

from i3core.plugins.inference.builtin import ServerConfig, ServerProcesses, model_args, receiver_args
from i3core.plugins.inference.engine import EngineBase, Sequence, draw
from i3core.protocols import Model

MAX_LENGTH_DRAWS = 100
"""Rejection sampling of the truncated length distribution gives up (and clips) after this many draws."""
VERSION_NOISE = 0.3
"""Scale of the per-version perturbation of the bigram logits."""


class TimingModel(BaseModel):
    """How long the simulated servers take, and how long their completions are."""

    model_config = ConfigDict(extra="forbid")

    step_base_ms: float = Field(20.0, ge=0, description="Fixed cost of one decode step (reading the weights).")
    step_per_seq_ms: float = Field(0.1, ge=0, description="Added to a decode step per running sequence.")
    prefill_per_token_ms: float = Field(0.02, ge=0, description="Added to a step per prompt token it admits.")
    update_pause_ms: float = Field(50.0, ge=0, description="Added to the step after a weight update.")
    length_min: int = Field(50, ge=1, description="Shortest completion, in tokens.")
    length_median: float = Field(150.0, gt=0, description="Median of the (untruncated) lognormal completion length.")
    length_max: int = Field(600, ge=1, description="Longest completion, in tokens.")
    length_sigma: float = Field(0.9, ge=0, description="Log-standard deviation of the completion length.")
    seed: int = Field(0, description="Seed of the bigram table; server i samples with seed + i.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.length_min > self.length_max:
            raise ValueError(f"length_min ({self.length_min}) must be <= length_max ({self.length_max})")
        return self


def draw_length(rng: random.Random, model: TimingModel) -> int:
    """One completion length from the truncated lognormal of ``model``."""
    for _ in range(MAX_LENGTH_DRAWS):
        length = round(rng.lognormvariate(math.log(model.length_median), model.length_sigma))
        if model.length_min <= length <= model.length_max:
            return length
    return min(max(length, model.length_min), model.length_max)


class SimEngine(EngineBase):
    """Continuous batching with modelled step times and bigram tokens; see the module docstring."""

    computes_logits = False

    def __init__(self, model: TimingModel, *, vocab_size: int, sample_vocab: int, max_slots: int, max_len: int,
                 version: int = 0, index: int = 0, tokenizer=None):
        super().__init__(max_slots=max_slots, max_len=max_len, vocab_size=vocab_size, version=version,
                         tokenizer=tokenizer)
        self.timing = model
        self.sample_vocab = min(sample_vocab, vocab_size)
        self._base = torch.randn(self.sample_vocab, self.sample_vocab, generator=torch.Generator().manual_seed(model.seed))
        self.logits = self._table(version)
        self._rng = random.Random(model.seed + index)
        self._gen = torch.Generator().manual_seed(model.seed + index)
        self._targets: dict[int, int] = {}
        self._pause_s = 0.0
        self._deadline = 0.0

    def _table(self, version: int) -> torch.Tensor:
        noise = torch.randn(self._base.shape, generator=torch.Generator().manual_seed(self.timing.seed * 1_000_003 + version))
        return self._base + VERSION_NOISE * noise

    def step(self) -> list[Sequence]:
        start = time.perf_counter()
        prompt_tokens = 0
        while self.waiting and self._free:
            seq = self.waiting.pop(0)
            seq.slot = self._free.pop()
            prompt_tokens += len(seq.request.prompt_ids)
            self._targets[seq.id] = draw_length(self._rng, self.timing)
            self.running[seq.id] = seq
        decoding = list(self.running.values())
        finished = []
        if decoding:
            self._decode(decoding)
            for seq in decoding:
                if self._maybe_finish(seq):
                    finished.append(seq)
                    del self.running[seq.id]
                    del self._targets[seq.id]
        t = self.timing
        cost_ms = t.step_base_ms + t.step_per_seq_ms * len(decoding) + t.prefill_per_token_ms * prompt_tokens
        cost_s, self._pause_s = cost_ms / 1000 + self._pause_s, 0.0
        # Back-to-back steps end at deadlines cost_s apart, so host overhead (a late wake-up on a busy machine, the
        # HTTP work between steps) shorter than a step is hidden as a GPU would; never faster than the model.
        back_to_back = start - self._deadline < cost_s
        self._deadline = (self._deadline if back_to_back else start) + cost_s
        time.sleep(max(0.0, self._deadline - time.perf_counter()))
        self.steps += 1
        return finished

    def _decode(self, seqs: list[Sequence]) -> None:
        """One token per sequence: from the bigram row of its last token, stop tokens masked, until its length."""
        last = [s.token_ids[-1] if s.token_ids else s.request.prompt_ids[-1] for s in seqs]
        rows = self.logits[torch.tensor(last).clamp_max(self.sample_vocab - 1)]
        temperature = torch.tensor([s.request.temperature or 1.0 for s in seqs])[:, None]
        full = torch.log_softmax(rows / temperature, dim=-1)
        masked = rows.clone()
        by_stops: dict[tuple[int, ...], list[int]] = {}
        for i, seq in enumerate(seqs):
            by_stops.setdefault(seq.request.stop_token_ids, []).append(i)
        for stops, index in by_stops.items():  # one masking per distinct stop set (usually one per step)
            kept = [t for t in stops if t < self.sample_vocab]
            if kept:
                masked[torch.tensor(index)[:, None], torch.tensor(kept)[None, :]] = -math.inf
        masked = torch.log_softmax(masked / temperature, dim=-1)
        greedy = torch.tensor([s.request.temperature == 0 for s in seqs])
        drawn = draw(masked.exp(), self._gen)  # the engine's inverse-CDF draw: torch.multinomial costs ~7 ms here
        tokens = torch.where(greedy, masked.argmax(-1), drawn)
        sampled = masked.gather(1, tokens[:, None])[:, 0].tolist()
        tokens = tokens.tolist()
        for i, seq in enumerate(seqs):
            ends = len(seq.token_ids) + 1 >= self._targets[seq.id]
            if ends and seq.request.stop_token_ids:  # the length model says stop: emit the first stop token
                token = seq.request.stop_token_ids[0]
                seq.token_ids.append(token)
                seq.logprobs.append(float(full[i, token]) if token < self.sample_vocab else 0.0)
            else:
                seq.token_ids.append(tokens[i])
                seq.logprobs.append(sampled[i])
            seq.versions.append(self.version)

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        self._targets.pop(seq.id, None)

    def stage(self, path: Path) -> Path:
        """Check that ``path`` holds a readable ``model.safetensors`` (its tensors are not used)."""
        weights = Path(path) / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"no model.safetensors under {path}")
        try:
            with safe_open(str(weights), framework="pt") as handle:
                if not list(handle.keys()):
                    raise ValueError(f"{weights} holds no tensors")
        except SafetensorError as exc:
            raise ValueError(f"{weights}: {exc}") from None
        return weights

    def stage_tensors(self, tensors: dict) -> dict:
        if not tensors:
            raise ValueError("the update holds no tensors")
        return tensors

    def load_state(self, state, version: int) -> None:
        self.logits = self._table(version)
        self.version = version
        self._pause_s += self.timing.update_pause_ms / 1000


class SimulatedSource(ServerProcesses):
    """Rollout source ``simulated``: ``servers`` simulated server processes (see the module docstring)."""

    class Config(ServerConfig):
        max_len: int = Field(1024, ge=8, description="Longest prompt + completion, in tokens.")
        timing: TimingModel = Field(default_factory=TimingModel, description="The decode-time and length model.")

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None,
                model: dict | None = None) -> list[str]:
        return [
            sys.executable, "-m", "i3core.plugins.inference.server",
            "--model-dir", str(model_dir), "--engine", "simulated", "--host", self.config.host, "--port", str(port),
            "--max-slots", str(self.config.max_slots), "--max-len", str(self.config.max_len),
            "--version", str(version), "--index", str(index), "--timing", self.config.timing.model_dump_json(),
            *model_args(model), *receiver_args(receiver, index),
        ]  # fmt: skip

    def client(self, url: str, tokenizer, stop_token_ids: list[int], stop: list[str] = ()):
        """The orchestrator's client; no stop strings: a simulated completion's length is the length model's."""
        return super().client(url, tokenizer, stop_token_ids)


def simulated_engine(model_dir: Path, model: Model, timing: TimingModel, *, max_slots: int, max_len: int,
                     version: int, index: int = 0) -> SimEngine:
    """A :class:`SimEngine` with the vocabulary of the model under ``model_dir`` (its ``config.json``), sampling
    among the tokens of ``model``'s tokenizer."""
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokenizer = model.tokenizer()
    return SimEngine(timing, vocab_size=vocab_size, sample_vocab=tokenizer.get_vocab_size(),
                     max_slots=max_slots, max_len=max_len, version=version, index=index, tokenizer=tokenizer)
