"""The trainer role: one process per rank under torchrun (gloo on CPU, NCCL on GPU).

Loop: wait for ``batches/step_N.pt`` -> recompute per-token logprobs (chunked
log-softmax, each chunk recomputed in backward so a batch's ``[T, V]`` float32
logits never exist at once) -> loss plugin -> backward over micro-batches with
one global normaliser -> clip -> optimizer plugin -> publish weights version N
through the weight-sync plugin (every rank takes part: ``filesystem`` gathers
and rank 0 writes ``broadcasts/step_N/`` + STABLE; ``broadcast`` streams the HF
tensors layer by layer from rank 0) -> metrics. With ``[trainer] stream_groups``
the wait runs forward and backward on each early part of the batch
(``batch_parts/step_N_K.pt``) as it appears, its loss divided by 1; once the
batch is whole the rest follows and the summed gradients are divided by the
batch's normaliser: the same step, started while the batch still generates.

Unlike a textbook trainer, the model trains with every dropout and jitter
off (``[trainer] disable_dropout``, the default): the engine samples without
them, and a trainer logprob drawn with a random mask would bias every ratio
(:func:`disable_dropout`).

Before RL, an optional SFT warm start trains cross-entropy on the
environment's demonstrations with the same model, packing and publishing;
its result is published as version 0, the policy the servers start from.

Run: ``torchrun --standalone --nproc-per-node 1 -m i3core.loop.trainer plugins.toml``; with ``--resume`` it
continues the run from its newest complete checkpoint, or starts it over when there is none
(:mod:`i3core.loop.resume`). SIGTERM (a scheduler's time limit or preemption): the trainer finishes the step
it is in, checkpoints it and exits with 143; a restarted orchestrator's RESTART file: the same, exit 75.
"""

import argparse
import ctypes
import functools
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as recompute

from i3core.loop import checkpoint, resume
from i3core.config import RunConfig, load_config, with_defaults
from i3core.errors import I3Error, exception_line
from i3core.files import atomic_write_bytes, disk_full, write_torch
from i3core.lifetime import run_gone
from i3core.packed import predecessors
from i3core.loop.checkpoint import full_disk_message
from i3core.loop.packing import Sample, pack
from i3core.loop.paths import RunPaths
from i3core.loop.perf import SavedActivations, matmul_peak_flops
from i3core.types import LossInputs, TrainBatch

SIGTERM_EXIT = 128 + signal.SIGTERM
STOP_EXITS = {"SIGTERM": SIGTERM_EXIT, "SIGINT": 128 + signal.SIGINT}
"""The trainer's exit code when it stopped on a signal, checkpointed (else a restart's)."""
"""The trainer stopped on SIGTERM after checkpointing its last step (the scheduler requeues the job)."""
STOCHASTIC_ATTRS = re.compile(r"dropout|drop_?prob|pdrop|layerdrop|jitter", re.IGNORECASE)
"""Float attributes of a module that make training random (transformers' ``attention_dropout``, OPT's ``dropout``
and ``layerdrop``, Mixtral's ``jitter_noise``, ...): their forwards apply them only in train mode."""
BATCH_POLL_S = 0.0005
"""How often the trainer looks for its next batch: the wait is on the critical path of every step (a few
microseconds of CPU a look; a colocated trainer waits for the orchestrator's ring instead:
:mod:`i3core.loop.doorbell`)."""


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Turn off every dropout and jitter of ``model`` in place, while it stays in train mode (which activation
    checkpointing and MoE auxiliary terms may read): each ``nn.Dropout*`` gets ``p = 0`` and every positive float
    attribute named like :data:`STOCHASTIC_ATTRS` becomes 0. The model's config (what is published) is left as it
    is. Returns what was turned off (``name.attr``)."""
    off = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            off.append(f"{name or 'model'}.p")
        for attr, value in list(vars(module).items()):
            if type(value) is float and value > 0 and STOCHASTIC_ATTRS.search(attr):
                setattr(module, attr, 0.0)
                off.append(f"{name or 'model'}.{attr}")
    return off


def token_logprobs(model, input_ids, position_ids, chunk: int, temperature: float = 1.0,
                   where: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, S]`` log p(input_ids[:, t] | the tokens it sees) under ``model``; 0 at a sample's first token.

    A token is predicted by the hidden state of the token before it, or in a prefix tree by its prompt's last
    token for a branch's first (:func:`i3core.packed.predecessors`). ``where`` ``[R, S]`` (bool): the only tokens
    whose logprob is wanted (the loss tokens); the LM head and the log-softmax run on those alone and every other
    entry is 0 (None: every token). The log-softmax over the vocabulary runs ``chunk`` tokens at a time and is
    recomputed in backward, so at most ``[chunk, V]`` float32 logits are alive.
    """
    hidden = model(input_ids, position_ids)
    source = predecessors(position_ids.to(hidden.device))
    wanted = source >= 0 if where is None else where.to(source.device) & (source >= 0)
    rows, cols = wanted.nonzero(as_tuple=True)
    flat_hidden = hidden[rows, source[rows, cols]]
    flat_targets = input_ids[rows, cols]

    def chunk_logprobs(h, targets):
        logits = model.logits(h).float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]

    pieces = [
        recompute(chunk_logprobs, h, t, use_reentrant=False)
        for h, t in zip(flat_hidden.split(chunk), flat_targets.split(chunk))
    ]
    picked = torch.cat(pieces)  # an empty selection still gives one (empty) chunk: the head stays in the graph
    return picked.new_zeros(wanted.shape).masked_scatter(wanted, picked)


def _whole_sample_at(versions: torch.Tensor, sequence_ids: torch.Tensor, mask: torch.Tensor, version: int):
    """``[T]`` bool: tokens of samples whose every loss token was sampled by ``version``.

    Only those are comparable one to one with the trainer's logprobs: a token
    generated after an in-flight update still attends to keys computed by the
    weights before it.
    """
    num = int(sequence_ids.max()) + 1
    off = (mask & (versions != version)).long()
    bad = torch.zeros(num, dtype=torch.long, device=sequence_ids.device).index_add_(0, sequence_ids, off)
    return bad[sequence_ids] == 0


def micro_batches(batch: TrainBatch, rows: int):
    for start in range(0, batch.input_ids.shape[0], rows):
        span = slice(start, start + rows)
        yield {
            "input_ids": batch.input_ids[span],
            "position_ids": batch.position_ids[span],
            "loss_mask": batch.loss_mask[span],
            "advantages": batch.advantages[span],
            "inference_logprobs": batch.inference_logprobs[span],
            "sequence_ids": batch.sequence_ids[span],
        }


@dataclass
class StepSums:
    """What a step's micro-batches add up to (the loss plugin's token-weighted metrics, the logprob mismatch),
    over the batch's early parts and then the rest; ``rows``: the batch rows accumulated so far."""

    metrics: dict[str, float] = field(default_factory=dict)
    loss: float = 0.0
    abs_diff: float = 0.0
    tokens: int = 0
    same_diff: float = 0.0
    """|trainer - inference logprob| over tokens sampled by exactly these weights (engine vs trainer numerics)."""
    same_tokens: int = 0
    kl: float = 0.0
    """k3 estimate of KL(inference || trainer), summed over loss tokens with finite logprobs."""
    kl_tokens: int = 0
    activation_bytes: int = 0
    rows: int = 0
    compute_s: float = 0.0
    """Seconds spent on the early parts."""

    def add(self, part: "StepSums") -> None:
        """Add a micro-batch's sums (its ``rows`` and ``compute_s`` are the caller's to count)."""
        for key, value in part.metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value
        self.loss += part.loss
        self.abs_diff += part.abs_diff
        self.tokens += part.tokens
        self.same_diff += part.same_diff
        self.same_tokens += part.same_tokens
        self.kl += part.kl
        self.kl_tokens += part.kl_tokens
        self.activation_bytes = max(self.activation_bytes, part.activation_bytes)


def _rows_from(batch: TrainBatch, start: int) -> TrainBatch:
    """``batch`` without its first ``start`` rows (sample ids kept: a sample never spans rows)."""
    return TrainBatch(**{name: getattr(batch, name)[start:] for name in TrainBatch.ROWS}, num_samples=batch.num_samples)


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (DTensor; a collective), or ``value`` itself."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _plain(value) -> float:
    """A float from a tensor that may be a DTensor (FSDP2 gives sharded scalars)."""
    return float(_full_tensor(value))


class PublishedWeights:
    """One weight version as the trainer hands it to the weight sync; every rank gets one.

    A transport takes the weights either whole (:meth:`gather` then
    :meth:`save_hf`, e.g. to write a directory) or streamed
    (:meth:`hf_tensors`, HF layout one layer at a time). Both are
    collectives on a sharded model: every rank must call the same one.
    """

    def __init__(self, trainer: "Trainer", version: int, initial: bool = False):
        self.version = version
        self.initial = initial
        """The first version this trainer publishes (0, or the step it resumed from): the servers start from it."""
        self.rank = trainer.rank
        self._trainer = trainer

    def gather(self):
        """The whole model on rank 0, None elsewhere."""
        trainer = self._trainer
        state = trainer.full_state()
        return trainer._unsharded_model(state) if trainer.rank == 0 else None

    def save_hf(self, model, directory: Path) -> None:
        """Write ``model`` (from :meth:`gather`) as an HF directory: an adapter's own, or with
        :attr:`Trainer.publish_merged` the base with the adapter merged into it (PEFT's merge, the base read from
        its directory at every version)."""
        component = self._trainer.model_component
        if not self._trainer.publish_merged:
            component.save_hf(model, directory)
            return
        adapter = Path(directory).with_name(f".{Path(directory).name}.adapter")
        shutil.rmtree(adapter, ignore_errors=True)
        try:
            component.save_merged(component.save_hf(model, adapter), directory)
        finally:
            shutil.rmtree(adapter, ignore_errors=True)

    def hf_tensors(self):
        """``(hf_name, tensor)`` in the HF layout, layer by layer, gathered as they go (full tensors on every rank)."""
        return self._trainer.model_component.hf_tensors(self._trainer.model)


class Trainer:
    """One rank of the trainer. With more than one rank the model component's ``parallelize`` shards every
    decoder layer and the root with FSDP2 (see :class:`~i3core.protocols.Model`), each rank takes every
    ``world``-th row of a batch, and the loss is scaled by ``world`` because FSDP2 averages gradients over ranks
    while the loss is already normalised by the global token count."""

    def __init__(self, config: RunConfig, resume_step: int | None = None, rewind: bool = False, output=None,
                 doorbell=None):
        """:param resume_step: the checkpoint to continue from; :param rewind: undo what the run did after it (after
        step 0 with no checkpoint) before the first version goes out (:func:`i3core.loop.resume.rewind`);
        :param output: where the trainer's lines go (default stdout; a colocated trainer's: its log file);
        :param doorbell: a colocated trainer's :class:`~i3core.loop.doorbell.Doorbell` (rung at each version and
            metrics file, waited on for batches)."""
        self.config = config
        self.output = output
        self.doorbell = doorbell
        self.rewind = rewind
        self.stopping: str | None = None
        """Why the trainer stops after the step it is in: "SIGTERM", or "restart" (a restarted orchestrator)."""
        self.paths = RunPaths(config.run.out)
        self.model_component = config.get("model").build()
        self.weight_sync = config.get("weight_sync").build()
        torch.manual_seed(config.run.seed)
        self.model = self.model_component.build(seed=config.run.seed)
        self.model.train()
        self.trained = checkpoint.trained_names(self.model)
        """Names of the tensors training changes, when the model freezes some (an adapter on a frozen base):
        checkpoints and published versions hold those alone. None: every tensor."""
        source = config.get("inference")
        merged = getattr(source.component.cls, "merged_adapter", None) if source is not None else None
        self.publish_merged = self.trained is not None and callable(merged) and merged(config.get("model").to_dict())
        """Publish each version as the base with the adapter merged, when the servers cannot take an adapter on
        this base (vLLM on a mixture-of-experts base: ``VllmSource.merged_adapter``)."""
        if config.trainer.disable_dropout:
            off = disable_dropout(self.model)
            if off:
                print(json.dumps({"dropout_off": len(off), "first": off[:4]}), file=self.output, flush=True)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._plain = None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.resume_step = resume_step
        if resume_step is not None:  # the full state, loaded before sharding
            self._trainer_state = self._load_resume_state(resume_step)
        # The model shards itself (FSDP2 per decoder layer and the root) and applies its activation checkpointing.
        self.model_component.parallelize(self.model, world=self.world,
                                         checkpoint=config.trainer.activation_memory == "checkpoint",
                                         seq_len=config.trainer.seq_len)
        alone_on_cpu = self.world == 1 and self.device.type == "cpu"
        self.micro_batch_threads = config.trainer.micro_batch_threads if alone_on_cpu else 1
        """Micro-batches run at once (``[trainer] micro_batch_threads``): one rank on a CPU only, where no rank's
        collectives can interleave and the threads share the cores, not one device's stream."""
        self.micro_batch_pool = ThreadPoolExecutor(self.micro_batch_threads, thread_name_prefix="micro-batch") \
            if self.micro_batch_threads > 1 else None

    def local_rows(self, batch: TrainBatch) -> TrainBatch:
        """This rank's rows; the batch is padded with empty rows so every rank runs every collective."""
        if self.world == 1:
            return batch
        rows = batch.input_ids.shape[0]
        pad = (-rows) % self.world
        fields = {}
        for name in TrainBatch.ROWS:
            tensor = getattr(batch, name)
            if pad:
                filler = torch.zeros((pad, tensor.shape[1]), dtype=tensor.dtype)
                if name == "sequence_ids":
                    filler.fill_(batch.num_samples)
                if name == "versions":
                    filler.fill_(-1)
                tensor = torch.cat([tensor, filler])
            fields[name] = tensor[self.rank :: self.world]
        return TrainBatch(**fields, num_samples=batch.num_samples)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The unsharded state dict on rank 0, in host memory (None elsewhere); a collective when sharded. Where
        the model freezes some tensors (an adapter on a frozen base), the trained ones alone (:attr:`trained`).

        Each tensor is gathered in turn, so a rank holds one unsharded tensor at a time. The model's own
        ``state_dict`` names are kept (torch.distributed.checkpoint's walk of the module tree cannot follow
        state-dict hooks that rename, such as torchtitan's fused QKV projection).
        """
        state = checkpoint.saved_state(self.model.state_dict(), self.trained)
        if self.world == 1:
            return state
        for key, value in state.items():
            full = _full_tensor(value)
            if self.rank == 0:
                state[key] = full.detach().cpu()
        return state if self.rank == 0 else None

    def _unsharded_model(self, state):
        """The model holding the gathered ``state``: a plain (unsharded) copy built once and refilled at every
        publish, since building may mean reading a whole checkpoint (``hf``'s ``from_pretrained``)."""
        if self.world == 1:
            return self.model
        if self._plain is None:
            self._plain = self.model_component.build(seed=0)
        self._plain.load_state_dict(state, strict=self.trained is None)
        return self._plain

    # -- publishing ----------------------------------------------------------

    def publish(self, version: int, initial: bool = False) -> None:
        """Publish the weights as ``version`` through the weight-sync component (every rank calls it)."""
        self.weight_sync.publish(self.paths.broadcasts, PublishedWeights(self, version, initial))

    # -- SFT -----------------------------------------------------------------

    def sft(self) -> None:
        cfg = self.config.sft
        env = self.config.get("env").build()
        tokenizer = self.model_component.tokenizer()
        sft_ids = getattr(env, "sft_ids", None)
        if sft_ids is None:  # an env with only demonstration(): its text prompt and demonstration, encoded
            def sft_ids(example, tokenizer):
                text = env.demonstration(example)
                return None if text is None else (tokenizer.encode(example.prompt).ids, tokenizer.encode(text, add_special_tokens=False).ids)
        demonstrations = [pair for e in env.examples() if (pair := sft_ids(e, tokenizer)) is not None]
        if not demonstrations:
            raise I3Error(f"sft.steps = {cfg.steps} but env {self.config.get('env').name!r} has no demonstrations; "
                          "set sft.steps = 0")
        rng = random.Random(self.config.run.seed)
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                      weight_decay=0.0)
        started = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            if not self._all_ok(self.stopping is None):
                raise Stopped(f"{self.stopping} during the SFT warm start: nothing to checkpoint yet",
                              STOP_EXITS.get(self.stopping, SIGTERM_EXIT))
            samples = []
            for prompt, answer in rng.sample(demonstrations, min(cfg.batch_size, len(demonstrations))):
                n = len(prompt) + len(answer)
                samples.append(Sample(prompt + answer, [False] * len(prompt) + [True] * len(answer), [0.0] * n,
                                      [-1] * n, 0.0))
            batch = pack(samples, self.config.trainer.seq_len)
            total = batch.loss_mask.sum().clamp_min(1)
            batch = self.local_rows(batch)
            optimizer.zero_grad(set_to_none=True)
            mask = batch.loss_mask.to(self.device)
            lp = token_logprobs(self.model, batch.input_ids.to(self.device), batch.position_ids.to(self.device),
                                self.config.trainer.logprob_chunk, where=mask)
            loss = -(lp * mask).sum() / total
            (loss * self.world).backward()
            norm = _plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.trainer.max_grad_norm))
            if not math.isfinite(norm):
                raise I3Error(f"sft step {step}: the gradient is not finite (norm {norm}, loss {loss.item()}): "
                              f"a learning rate too high for this model (sft.lr = {cfg.lr}) is the usual cause")
            optimizer.step()
            if self.rank == 0 and (step % 50 == 0 or step == cfg.steps):
                print(json.dumps({"sft_step": step, "sft_loss": round(loss.item(), 4),
                                  "sft_s": round(time.perf_counter() - started, 3)}), file=self.output, flush=True)

    # -- RL ------------------------------------------------------------------

    def wait_for_batch(self, step: int, on_part=None) -> TrainBatch | None:
        """The batch of ``step``; None when the trainer is to stop first (STOP, its run gone, SIGTERM, RESTART).

        ``on_part``: called with each early part of the batch (``[trainer] stream_groups``) as it appears, in
        order, every part before the batch is returned (the orchestrator writes them all before the batch).
        """
        path = self.paths.batch(step)
        part = 0

        def take_parts():  # every part written so far, in order
            nonlocal part
            while on_part is not None and (part_path := self.paths.batch_part(step, part)).exists():
                on_part(torch.load(part_path, weights_only=False))
                part += 1

        bell = self.doorbell
        while True:
            if bell is not None:
                bell.trainer_clear()  # before the look: a ring from here on ends the wait below
            take_parts()
            if path.exists():
                break
            if self.paths.restart().exists():
                self.stopping = self.stopping or "restart"
            if self.stopping or self.paths.stop().exists() or run_gone():  # a killed run cannot write STOP
                return None
            if bell is not None:
                bell.trainer_wait()
            else:
                time.sleep(BATCH_POLL_S)
        take_parts()  # those written between the last look and the batch
        return torch.load(path, weights_only=False)

    def on_sigterm(self, signum, frame) -> None:
        """A scheduler's notice (time limit, preemption): stop after the step in progress, checkpointed."""
        self.stopping = "SIGTERM"

    def on_sigint(self, signum, frame) -> None:
        """Ctrl-C, which a terminal sends to every process of ``i3core run``'s group, this one too: stop after the
        step in progress, checkpointed, as the run asks of it (before, the KeyboardInterrupt landed in a backward
        pass and the run's steps were lost). A second Ctrl-C interrupts at once."""
        if self.stopping == "SIGINT":
            raise KeyboardInterrupt
        self.stopping = "SIGINT"

    def train_step(self, batch: TrainBatch, loss_fn, optimizer, version: int,
                   streamed: StepSums | None = None) -> dict[str, float]:
        """One optimizer step on ``batch``; the weights being trained are policy ``version``.

        ``streamed``: what :meth:`accumulate` already added up from the batch's early parts (its first
        ``batch.streamed_rows`` rows); their gradients were summed unnormalised, and are divided by the batch's
        normaliser here, once it is known.
        """
        tcfg = self.config.trainer
        # The global normaliser: loss tokens with a finite inference logprob (others are dropped by the loss).
        total = int((batch.loss_mask & torch.isfinite(batch.inference_logprobs)).sum())
        if streamed is not None and streamed.rows and streamed.rows != batch.streamed_rows:
            print(f"step of version {version}: {streamed.rows} rows came early but the batch says "
                  f"{batch.streamed_rows}; training the whole batch again", file=self.output or sys.stderr, flush=True)
            streamed = None
        if streamed is None or not streamed.rows:
            optimizer.zero_grad(set_to_none=True)
            sums = StepSums()
            self.accumulate(batch, loss_fn, version, sums, normaliser=total)
        else:
            sums = streamed
            self.accumulate(_rows_from(batch, batch.streamed_rows), loss_fn, version, sums, normaliser=1)
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.div_(max(total, 1))
            sums.loss /= max(total, 1)
        grad_norm = _plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tcfg.max_grad_norm))
        if not math.isfinite(grad_norm):  # the step would make every weight NaN: stop before it
            raise I3Error(f"step {version + 1}: the gradient is not finite (norm {grad_norm}, loss "
                          f"{sums.loss}): the weights stay those of step {version}; a learning rate too high for "
                          "this model (optimizer.lr) is the usual cause")
        optimizer.step()
        loss_sum, abs_diff, n_tokens = sums.loss, sums.abs_diff, sums.tokens
        same_diff, same_tokens, kl_sum, kl_tokens = sums.same_diff, sums.same_tokens, sums.kl, sums.kl_tokens
        if self.world > 1:  # sums over ranks; the loss plugin's own metrics stay rank 0's
            totals = torch.tensor([loss_sum, abs_diff, n_tokens, same_diff, same_tokens, kl_sum, kl_tokens],
                                  dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
            dist.all_reduce(totals)
            loss_sum, abs_diff, n_tokens, same_diff, same_tokens, kl_sum, kl_tokens = totals.tolist()
        metrics = {k: v / max(n_tokens, 1) for k, v in sums.metrics.items()}
        metrics["memory/activations_mb"] = sums.activation_bytes / 2**20
        if torch.cuda.is_available():
            metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        metrics.update(
            {
                "loss": loss_sum,
                "grad_norm": grad_norm,
                "mismatch/mean_abs_logprob_diff": abs_diff / max(n_tokens, 1),
                # The trainer's own, whatever the loss: k3 = r - 1 - log r, r = exp(trainer - inference logprob)
                "mismatch/kl": kl_sum / max(kl_tokens, 1),
                "mismatch/same_version_abs_diff": same_diff / same_tokens if same_tokens else float("nan"),
                "mismatch/same_version_tokens": float(same_tokens),
                "train/loss_tokens": float(total),
                "train/rows": float(batch.input_ids.shape[0]),
                "train/streamed_rows": float(batch.streamed_rows),
            }
        )
        return metrics

    def accumulate_part(self, part: TrainBatch, loss_fn, optimizer, version: int, sums: StepSums) -> None:
        """An early part of a step's batch: its gradients summed, unnormalised, into the step's (the first part
        clears what the last step left)."""
        started = time.perf_counter()
        if not sums.rows:
            optimizer.zero_grad(set_to_none=True)
        self.accumulate(part, loss_fn, version, sums, normaliser=1)
        sums.compute_s += time.perf_counter() - started

    def accumulate(self, batch: TrainBatch, loss_fn, version: int, sums: StepSums, normaliser: int) -> None:
        """Forward and backward over ``batch``'s micro-batches, gradients added to those already there, with the
        loss divided by ``normaliser``; what the step's metrics need is added to ``sums``. With
        ``micro_batch_threads`` > 1 the micro-batches run that many at once (:attr:`micro_batch_pool`)."""
        rows = batch.input_ids.shape[0]
        batch = self.local_rows(batch)
        per = self.config.trainer.micro_batch_rows
        pool = self.micro_batch_pool
        if pool is not None:  # every thread a share of the rows
            per = max(1, min(per, -(-batch.input_ids.shape[0] // self.micro_batch_threads)))
        one = functools.partial(self.micro_batch, loss_fn=loss_fn, version=version, normaliser=normaliser)
        parts = zip(micro_batches(batch, per), batch.versions.split(per))
        for part in (pool.map(one, *zip(*parts)) if pool is not None else itertools.starmap(one, parts)):
            sums.add(part)  # in the micro-batches' order, whatever order they finished in
        sums.rows += rows

    def micro_batch(self, mb: dict, versions: torch.Tensor, loss_fn, version: int, normaliser: int) -> StepSums:
        """Forward and backward over one micro-batch (gradients added to the parameters'); its share of the sums."""
        tcfg = self.config.trainer
        sums = StepSums()
        mb = {key: value.to(self.device) for key, value in mb.items()}
        versions = versions.to(self.device)
        with SavedActivations(self.model, offload=tcfg.activation_memory == "offload") as saved:
            lp = token_logprobs(self.model, mb["input_ids"], mb["position_ids"], tcfg.logprob_chunk,
                                where=mb["loss_mask"])
        sums.activation_bytes = saved.bytes
        mask = mb["loss_mask"].reshape(-1)
        out = loss_fn(
            LossInputs(
                trainer_logprobs=lp.reshape(-1),
                inference_logprobs=mb["inference_logprobs"].reshape(-1),
                advantages=mb["advantages"].reshape(-1),
                loss_mask=mask,
                sequence_ids=mb["sequence_ids"].reshape(-1),
                num_loss_tokens=normaliser,
            )
        )
        (out.loss * self.world).backward()
        sums.loss = out.loss.item()
        weight = int(mask.sum())
        sums.metrics = {key: value * weight for key, value in out.metrics.items()}  # token-weighted over micro-batches
        diff = (lp.detach().reshape(-1) - mb["inference_logprobs"].reshape(-1))[mask]
        sums.abs_diff = float(diff.abs().sum())
        finite = diff[torch.isfinite(diff)]
        sums.kl = float((finite.exp() - 1 - finite).sum())
        sums.kl_tokens = len(finite)
        sums.tokens = weight
        same = _whole_sample_at(versions.reshape(-1), mb["sequence_ids"].reshape(-1), mask, version)[mask]
        sums.same_diff = float(diff[same].abs().sum())
        sums.same_tokens = int(same.sum())
        return sums

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def utilisation(self, batch: TrainBatch, compute_s: float, peak: float) -> dict[str, float]:
        """Model FLOPs of the step over its compute time, against ``peak`` (this machine's measured matmul
        FLOP/s per rank) times the ranks: ``perf/mfu``. Empty when the model has no FLOPs model."""
        flops_of = getattr(self.model_component, "train_flops", None)
        if flops_of is None:
            return {}
        flops = flops_of(self.model, batch.position_ids, batch.sequence_ids < batch.num_samples)
        achieved = flops / compute_s
        return {"perf/model_flops": flops, "perf/flops_per_s": achieved, "perf/peak_flops_per_s": peak,
                "perf/mfu": achieved / (peak * self.world)}

    # -- checkpoints ---------------------------------------------------------------

    def _load_resume_state(self, step: int) -> dict:
        """Load checkpoint ``step``'s model into the (not yet sharded) model; its trainer state for :meth:`run`."""
        directory = checkpoint.checkpoint_dir(self.paths.checkpoints, step)
        if step not in checkpoint.complete_steps(self.paths.checkpoints):
            raise I3Error(f"no complete checkpoint step_{step} under {self.paths.checkpoints}")
        state = checkpoint.read_torch(directory / checkpoint.TRAINER)
        if state["world"] != self.world:
            raise I3Error(f"checkpoint step_{step} was written by {state['world']} trainer processes; resume it "
                          f"with trainer.nproc = {state['world']} (now {self.world})")
        checkpoint.load_model(self.paths.checkpoints, step, self.model, checkpoint.base_identity(self.model_component))
        return state

    def _resume_optimizer(self, optimizer, schedule) -> None:
        directory = checkpoint.checkpoint_dir(self.paths.checkpoints, self.resume_step)
        saved = checkpoint.read_torch(directory / checkpoint.optimizer_file(self.rank))
        checkpoint.load_local_optimizer_state(optimizer, saved)
        schedule.load_state_dict(self._trainer_state["lr_schedule"])
        torch.set_rng_state(self._trainer_state["rng"])

    def _all_ok(self, ok: bool) -> bool:
        """Whether every rank is ``ok`` (a collective when sharded, so also a barrier)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def checkpoint(self, step: int, optimizer, schedule) -> None:
        """``checkpoints/step_N/`` (see :mod:`i3core.loop.checkpoint`), staged in ``.step_N.tmp`` and renamed into place;
        then checkpoints beyond the newest ``trainer.keep_checkpoints`` are deleted. A failed write (a full disk)
        removes the staging directory and leaves every complete checkpoint as it was."""
        root = self.paths.checkpoints
        target = checkpoint.checkpoint_dir(root, step)
        staging = target.with_name(f".{target.name}.tmp")
        model_state = self.full_state()
        error = None
        try:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                base = checkpoint.base_identity(self.model_component)
                write_torch(checkpoint.model_file(model_state, step, base), staging / checkpoint.MODEL)
                write_torch({"step": step, "world": self.world, "lr_schedule": schedule.state_dict(),
                             "rng": torch.get_rng_state()}, staging / checkpoint.TRAINER)
                orchestrator = self.paths.orchestrator_state(step)
                if orchestrator.exists():  # absent when the trainer runs on batches it did not get from a run
                    shutil.copyfile(orchestrator, staging / checkpoint.ORCHESTRATOR)
        except OSError as exc:
            error = exc
        if self._all_ok(error is None):
            try:
                write_torch(checkpoint.local_optimizer_state(optimizer), staging / checkpoint.optimizer_file(self.rank))
            except OSError as exc:
                error = exc
        ok = self._all_ok(error is None)
        if self.rank == 0 and ok:
            try:
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
            except OSError as exc:
                ok, error = False, exc
            else:
                checkpoint.prune(root, self.config.trainer.keep_checkpoints)
        if not ok:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            last = checkpoint.latest(root)
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error or "another rank failed")
            kept = f"the last complete checkpoint is step_{last}" if last is not None else "no checkpoint was written yet"
            raise I3Error(f"checkpoint step_{step} could not be written under {root}: {reason}; {kept}")

    def run(self) -> None:
        self.paths.make()
        start = self.resume_step or 0
        if self.rank == 0:
            if self.rewind:
                resume.claim(self.paths)
                resume.rewind(self.config.run.out, start)
            checkpoint.clear_staging(self.paths.checkpoints)
        self._all_ok(True)  # no rank looks for a batch before the rewind
        if self.config.sft.steps and self.resume_step is None:
            self.sft()
            release_freed_memory()  # the warm start's batches are bigger than RL's: what they held goes back
        # Everything the first step needs is ready before the first version goes out: the orchestrator starts
        # generating the moment it appears, and the peak-FLOPs probe would take the CPU from the first batch.
        loss_fn = self.config.get("loss").build()
        optimizer = self.config.get("optimizer").build().build(self.model.named_parameters())
        schedule = lr_schedule(optimizer, self.config.trainer, self.config.run.max_steps)
        if self.resume_step is not None:
            self._resume_optimizer(optimizer, schedule)
        peak = matmul_peak_flops(self.device)
        self.publish(start, initial=True)
        if self.rank == 0:
            resume.announce(self.paths, start)
        every = self.config.trainer.checkpoint_every
        last = start
        # early parts only for a trainer that runs alone: a rank stopping while another runs a part's collectives
        # would hang, and a launched job's ranks come from its node count, not from [trainer] nproc
        takes_parts = self.world == 1 and self.config.trainer.streams_groups
        for step in range(start + 1, self.config.run.max_steps + 1):
            streamed = StepSums()
            early = functools.partial(self.accumulate_part, loss_fn=loss_fn, optimizer=optimizer, version=step - 1,
                                      sums=streamed)
            batch = self.wait_for_batch(step, on_part=early if takes_parts else None)
            if not self._all_ok(batch is not None):  # every rank stops at the same step
                break
            start_time = time.perf_counter()
            metrics = self.train_step(batch, loss_fn, optimizer, version=step - 1, streamed=streamed)
            metrics["lr"] = optimizer.param_groups[0]["lr"]
            schedule.step()
            compute_s = time.perf_counter() - start_time + streamed.compute_s
            self.publish(step)
            self._ring()
            metrics["step_time_s"] = time.perf_counter() - start_time
            metrics.update(self.utilisation(batch, compute_s, peak))
            if self.rank == 0:
                atomic_write_bytes(self.paths.trainer_metrics(step), json.dumps(metrics).encode())
                self._ring()
            last = step
            if every and step % every == 0:
                self.checkpoint(step, optimizer, schedule)
            if not self._all_ok(self.stopping is None):
                break
        if last > start and not (every and last % every == 0):
            self.checkpoint(last, optimizer, schedule)

    def _ring(self) -> None:
        if self.doorbell is not None:
            self.doorbell.ring_orchestrator()


def release_freed_memory() -> None:
    """Hand the memory the C allocator keeps from freed blocks back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing): after a phase of big tensors (the SFT warm start), the process would otherwise hold its peak for the
    rest of the run."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def lr_schedule(optimizer, tcfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate of step s (1-based) is each group's lr times f(s - 1): a linear warm-up over
    ``lr_warmup_steps``, then ``constant``, or a ``linear``/``cosine`` decay to 0 at ``max_steps``."""
    warmup, decay = tcfg.lr_warmup_steps, tcfg.lr_decay

    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        if decay == "constant":
            return 1.0
        progress = min(1.0, (done - warmup) / max(1, max_steps - warmup))
        return 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main(argv=None, config: RunConfig | None = None, output=None, doorbell=None) -> int:
    """The trainer role on one rank. :param config: the run's config when the caller has read it from ``argv``'s
    config and overrides already (``i3core trainer``): it is not read again. :param output: a text stream for the
    trainer's lines and its error line (a colocated trainer's log file; default stdout and stderr).
    :param doorbell: a colocated trainer's rings to and from the orchestrator (:mod:`i3core.loop.doorbell`)."""
    parser = argparse.ArgumentParser(prog="i3core trainer", description="The trainer role (run it under torchrun).")
    parser.add_argument("config", type=Path, help="plugins.toml or a run's config.resolved.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value override")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STEP",
                        help="continue from checkpoint STEP of the run's output_dir (default: the newest complete "
                        "one; with none, the run starts over), undoing what the run did after it")
    args = parser.parse_args(argv)
    try:
        if config is None:
            config = with_defaults(*load_config(args.config, args.overrides))  # plugins.toml as `i3core run` reads it
        for section in ("model", "env", "loss", "optimizer", "weight_sync"):
            if config.get(section) is None:
                raise I3Error(f"the trainer needs a [{section}] section")
        torch.set_num_threads(config.trainer.threads)
        if "RANK" in os.environ and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        step = None
        if args.resume is not None:
            step = resume.start_step(config.run.out, required=False) if args.resume == "latest" \
                else _step_arg(args.resume)
            if step is not None:
                resume.check_unchanged(config)
        trainer = Trainer(config, resume_step=step, rewind=args.resume is not None, output=output, doorbell=doorbell)
        if threading.current_thread() is threading.main_thread():  # colocated: the run's process handles signals
            signal.signal(signal.SIGTERM, trainer.on_sigterm)
            signal.signal(signal.SIGINT, trainer.on_sigint)
        trainer.run()
        if dist.is_initialized():  # every rank done (rank 0 renames the last checkpoint) before any tears down
            dist.barrier()
        if trainer.stopping is not None:
            last = checkpoint.latest(trainer.paths.checkpoints)
            kept = f"checkpoint step_{last} written" if last is not None else "no checkpoint yet"
            raise Stopped(f"stopped on {trainer.stopping}: {kept}; continue with --resume",
                          STOP_EXITS.get(trainer.stopping, resume.RESTART_EXIT))
        return 0
    except I3Error as exc:
        print(f"error: {exc}", file=output or sys.stderr, flush=True)
        return getattr(exc, "exit_code", 1)
    except Exception as exc:
        if config is not None and disk_full(exc):
            print(f"error: {full_disk_message(config.run.out, exc)}", file=output or sys.stderr, flush=True)
            return 1
        if config is None or os.environ.get("I3CORE_DEBUG", "") not in ("", "0"):
            raise
        # a plugin's bug (a loss, an optimizer, a model) or ours: the traceback stays in this log, the run shows
        # the line below, which says where it was raised (before: "the trainer exited with 1; see trainer.log")
        traceback.print_exc(file=output or sys.stderr)
        print(f"error: the trainer failed: {exception_line(exc)} ({_raised_at(exc)})",
              file=output or sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, as ``file:line in function``: the innermost frame outside torch (a plugin's loss
    that hands torch a wrong shape is named, not torch's own function)."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    outside = [f for f in frames if not f.filename.startswith(torch_dir)] or frames
    frame = outside[-1]
    return f"raised at {frame.filename}:{frame.lineno} in {frame.name}"


class Stopped(I3Error):
    """The trainer stopped before the run's end on request (SIGTERM, a restart): its exit code says which."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _step_arg(text: str) -> int:
    if not text.isdigit():
        raise I3Error(f"--resume takes a step number (or nothing, for the newest checkpoint), not {text!r}")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
