"""Every hook an i3core plugin can implement, grouped by lifecycle.

Component hooks are called once at start-up, one per kind, and hand the plugin
a ``register(name, cls)`` callback. Event hooks are called on every plugin that
implements them; they are synchronous and must be cheap. Hot paths
(generation, sandbox exec, the loss) are methods on components, not hooks.
"""

from i3core import hookspec

# --------------------------------------------------------------------------
# Components: called once at start-up, before the config is validated
# --------------------------------------------------------------------------


@hookspec
def i3_register_losses(register):
    """Register loss components (the ``[loss]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; ``cls.Config`` is a pydantic model
        with ``extra="forbid"`` and ``cls(config)`` builds the component, whose
        ``__call__(LossInputs) -> LossOutput`` computes the loss.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_optimizers(register):
    """Register optimizer components (the ``[optimizer]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; ``cls(config).build(named_parameters)``
        returns a ``torch.optim.Optimizer``.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_sandboxes(register):
    """Register sandbox backends (the ``[sandbox]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; ``await cls(config).create()``
        returns a sandbox with ``exec``, ``write_file``, ``read_file`` and ``close``.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_schedulers(register):
    """Register orchestrator schedulers (the ``[scheduler]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; the scheduler keeps the pool of
        in-flight rollouts and decides what the trainer gets each step.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_envs(register):
    """Register environments (the ``[env]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; the environment owns a dataset,
        a rubric and ``async rollout(client, example)``.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_weight_syncs(register):
    """Register weight-sync transports (the ``[weight_sync]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; the transport moves a new policy
        version from the trainer to every inference server.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_rollout_sources(register):
    """Register rollout sources, i.e. inference backends (the ``[inference]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; the source starts or connects to
        inference servers and hands the orchestrator one client per server.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_models(register):
    """Register policy models (the ``[model]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; the component builds the torch
        module and converts between its layout and the Hugging Face layout.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_register_metric_sinks(register):
    """Register metric sinks (the ``[metrics]`` section).

    Called once when the plugin manager is loaded, before any config is read.

    :param register: ``register(name, cls)``; ``cls(config).open(output_dir)``
        starts the sink, ``write(step, metrics)`` records one trainer step and
        ``close()`` flushes it.
    :return: nothing; every implementation is called.
    """


# --------------------------------------------------------------------------
# Run lifecycle events: called on every implementation, synchronous and cheap
# --------------------------------------------------------------------------


@hookspec
def i3_on_run_start(config, output_dir):
    """The run has built every configured component and is about to start.

    Called once per role process, after components are built and before the
    first rollout or trainer step.

    :param config: the validated :class:`i3core.config.RunConfig`.
    :param output_dir: :class:`pathlib.Path` of the run's output directory.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_on_rollout_finished(rollout):
    """One rollout has finished generating and has been scored.

    Called by the orchestrator once per rollout, before it is grouped.

    :param rollout: the :class:`i3core.types.Rollout`; treat it as read-only.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_on_group_scored(group):
    """All rollouts of one prompt are scored; advantages are not computed yet.

    Called by the orchestrator once per group, after the env's group-level
    scoring (its rubric's group reward functions). An implementation may change the
    rewards of ``group.rollouts`` in place (reward shaping) or return ``False``
    to drop the whole group (filtering, e.g. groups with zero advantage).

    :param group: the :class:`i3core.types.Group`.
    :return: ``False`` to drop the group; ``None`` or ``True`` to keep it. Every
        implementation is called; the group is dropped if any returns ``False``.
    """


@hookspec
def i3_on_batch(batch, step):
    """A packed training batch is ready for the trainer.

    Called by the orchestrator once per trainer step, after packing and before
    the batch is handed to the trainer (with ``[trainer] stream_groups``, the
    trainer may have started on its first ``batch.streamed_rows`` rows).

    :param batch: the :class:`i3core.types.TrainBatch`; treat it as read-only.
    :param step: the trainer step (``int``, from 1) that will consume it.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_on_step_end(step, metrics):
    """One trainer step has finished.

    Called after the optimizer step and before the metrics are written to the
    metric sinks, so an implementation may add keys to ``metrics``.

    :param step: the trainer step that finished (``int``, from 1).
    :param metrics: ``dict[str, float]`` of the step's metrics; may be extended.
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_on_weights_updated(version):
    """Every inference server now serves a new policy version.

    Called by the orchestrator after the weight sync of ``version`` completed.

    :param version: the policy version now served (``int``, the trainer step
        that produced it; 0 is the initial policy).
    :return: nothing; every implementation is called.
    """


@hookspec
def i3_on_run_end(config, status):
    """The run is ending.

    Called once per role process, also when the run fails or is interrupted,
    after the last metrics are written. An implementation that raises after a
    completed run makes the process exit 1 with a line that says the run
    completed and names the plugin; after a failed or interrupted run it is a
    warning and the run's own error stands.

    :param config: the validated :class:`i3core.config.RunConfig`.
    :param status: ``"completed"``, ``"failed"`` or ``"interrupted"``.
    :return: nothing; every implementation is called.
    """
