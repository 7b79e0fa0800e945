"""plugins.toml -> a typed :class:`RunConfig`, with every problem reported at once.

Each component section names its component with ``use``; every other key is
validated against that component's ``Config`` (``extra="forbid"``). Problems
carry their TOML path, the valid keys and a "did you mean". Sections that are
absent are simply not configured: the role that needs one says so.

Settings that contradict each other across sections (a weight sync that keeps
fewer versions than the scheduler's lag needs, ...) are found by the
components themselves: a component class may define
``check_config(config, run) -> list[Problem]`` (a staticmethod), called with its own
validated ``Config`` and the whole :class:`RunConfig` once every section has
been validated, so they are reported with the other problems (see
:func:`cross_check`).
"""

import json
import math
import re
import stat
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from i3core.errors import ConfigError, I3Error, Problem, did_you_mean, exception_line
from i3core.manager import Plugins, load_plugins
from i3core.registry import KINDS, SECTION_KINDS, Component


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
"""What ``torch.manual_seed`` takes (``run.seed`` seeds torch's generators): a wider seed fails there, mid-start."""


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, if it is not a directory (nothing could be written
    under it)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


class RunSection(BaseModel):
    """``[run]``: what every role shares."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("run", description="Run name, used in logs and as the default output folder.")
    output_dir: Path | None = Field(None, description="Where metrics, logs and checkpoints go; default runs/<name>.")
    max_steps: int = Field(40, ge=1, description="Trainer steps to run.")
    seed: int = Field(0, ge=SEED_MIN, le=SEED_MAX, description="Seed for data order, sampling and initialisation.")
    keep_rollouts: bool = Field(True, description="Write every step's rollouts to rollouts/step_N.jsonl (text, "
                                                  "tokens, reward, outcome); `i3core rollouts RUN_DIR` prints them.")
    rollouts_max_mb: float = Field(1024.0, gt=0, description="Size cap of rollouts/: the oldest step files are "
                                                             "deleted first.")

    @field_validator("output_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == "":  # Path("") is the working directory: a run would write its files among the user's
            raise ValueError('must name a directory (leave it out for runs/<name>, or write "." for this one)')
        return value

    @field_validator("output_dir")
    @classmethod
    def _a_directory(cls, path: Path | None) -> Path | None:
        if path is not None and (existing := _file_in_the_way(path)) is not None:
            raise ValueError(f"{existing} is a file, not a directory")
        return path

    @model_validator(mode="after")
    def _default_a_directory(self) -> "RunSection":
        if self.output_dir is None and (existing := _file_in_the_way(self.out)) is not None:
            raise ValueError(f"the default output folder {self.out} (runs/<name>) cannot be made: {existing} is a "
                             "file, not a directory; set output_dir or another name")
        return self

    @property
    def out(self) -> Path:
        return self.output_dir if self.output_dir is not None else Path("runs") / self.name


class PluginsSection(BaseModel):
    """``[plugins]``: which installed plugins to load."""

    model_config = ConfigDict(extra="forbid")

    disable: list[str] = Field(default_factory=list, description="Plugin or distribution names to block.")


class TrainerSection(BaseModel):
    """``[trainer]``: how the trainer process packs, steps and saves."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(512, ge=8, description="Tokens per packed row; a sample never spans rows.")
    micro_batch_rows: int = Field(8, ge=1, description="Rows per forward/backward (gradient accumulation).")
    share_prompts: bool = Field(
        True, description="Pack the completions of one prompt as a prefix tree (the prompt computed once), where the "
                          "model component supports it (its prefix_trees attribute; tiny-moe and hf do).")
    stream_groups: bool = Field(
        False, description="Hand the trainer a batch's finished groups while the rest still generate: it runs their "
                           "forward and backward at once and steps when the batch is whole. Pays off where generation "
                           "is the slower half (long completions), above all with scheduler.max_sample_lag = 0: "
                           "on-policy batches with most of the training under the generation. One trainer rank (nproc "
                           "= 1); several train each batch whole.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    disable_dropout: bool = Field(
        True, description="Train with every dropout and router jitter of the model off (the engine samples without "
                          "them; with them the trainer's logprobs differ from the engine's on the same weights).")
    logprob_chunk: int = Field(1024, ge=1, description="Tokens per chunk of the log-softmax over the vocabulary.")
    nproc: int = Field(1, ge=1, description="Trainer processes (torchrun --nproc-per-node); >1 shards with FSDP2.")
    threads: int = Field(1, ge=1, description="torch CPU threads per trainer process.")
    micro_batch_threads: int = Field(
        1, ge=1, description="Micro-batches run at once, one Python thread each, their gradients summed into the same "
                             "parameters (one trainer rank on a CPU; otherwise 1). The batch's rows are split so that "
                             "each thread gets a share. On a small model a CPU core is used better by a micro-batch of "
                             "its own than by a share of every small op (threads); the gradient sums' order, and so "
                             "their last bits, then vary from run to run.")
    colocate: bool = Field(
        False, description="Run the trainer in the run's own process, a thread beside the orchestrator and the "
                           "`local` engine, instead of a process of its own: one torch runtime instead of two "
                           "(about 250 MB less on a CPU). Both roles share one interpreter and wake each other: "
                           "the fastest setting where they take turns (on-policy), slower where the trainer trains "
                           "while the engine generates (stream_groups on long completions: 2.2 against 2.6 steps/s). "
                           "One trainer rank, inference `local`, trainer.threads equal to inference.threads.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest complete checkpoints kept; older ones are deleted.")
    lr_warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up from lr/N to lr.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate after the warm-up: constant, or decayed to 0 at run.max_steps.")
    activation_memory: Literal["keep", "checkpoint", "offload"] = Field(
        "keep", description="Activations saved for backward: keep them, recompute each block (checkpoint), "
                            "or move them to host memory (offload).")  # fmt: skip

    @property
    def streams_groups(self) -> bool:
        """Whether ``stream_groups`` takes effect: one trainer rank (a rank stopping while another runs a part's
        collectives would hang, so several ranks train each batch whole). The trainer also checks the ranks it
        really has: ``i3core launch`` starts them by node count, not by ``nproc``; parts it does not take are
        trained with the rest of their batch."""
        return self.stream_groups and self.nproc == 1


class SftSection(BaseModel):
    """``[sft]``: a supervised warm start on the environment's demonstrations, before RL."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(0, ge=0, description="SFT optimizer steps (0: no warm start).")
    batch_size: int = Field(64, ge=1, description="Demonstrations per SFT step.")
    lr: float = Field(3e-3, gt=0, description="SFT learning rate (AdamW).")


FIXED_SECTIONS: dict[str, type[BaseModel]] = {
    "run": RunSection,
    "plugins": PluginsSection,
    "trainer": TrainerSection,
    "sft": SftSection,
}


@dataclass
class ComponentSpec:
    """One configured component: its section, the registered class and its validated config."""

    section: str
    component: Component
    config: BaseModel

    @property
    def kind(self) -> str:
        return self.component.kind

    @property
    def name(self) -> str:
        return self.component.name

    def build(self):
        return self.component.build(self.config)

    def to_dict(self) -> dict[str, Any]:
        """``{"use": name, **options}`` as plain JSON-able data (what :func:`build_component` takes back)."""
        return {"use": self.name, **self.config.model_dump(mode="json")}


class ComponentRef(BaseModel):
    """A component nested in another component's ``Config`` (an env group's ``[[env.members]]``).

    ``use`` names a registered component of ``kind``; every key the subclass
    does not declare is that component's option, validated against its
    ``Config`` together with the rest of the file (problems at
    ``env.members[0].key``). The owner builds it with :meth:`build`.
    """

    model_config = ConfigDict(extra="allow")
    kind: ClassVar[str]

    use: str = Field(description="The registered name of the nested component.")
    _spec: "ComponentSpec | None" = PrivateAttr(None)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def build(self):
        """The nested component, ``cls(config)``."""
        if self._spec is None:
            raise I3Error(f"{self.kind} {self.use!r} was not validated through the run config")
        return self._spec.build()


@dataclass
class RunConfig:
    """A validated plugins.toml."""

    run: RunSection
    plugins: PluginsSection = field(default_factory=PluginsSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sft: SftSection = field(default_factory=SftSection)
    components: dict[str, ComponentSpec] = field(default_factory=dict)
    source: Path | None = None

    def get(self, section: str) -> ComponentSpec | None:
        return self.components.get(section)

    def option(self, section: str, key: str, default: Any = None) -> Any:
        """The value of ``key`` in the component ``section``; ``default`` if the section or its key is absent."""
        spec = self.components.get(section)
        return default if spec is None else getattr(spec.config, key, default)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config (defaults filled in), as plain JSON-able data."""
        data: dict[str, Any] = {name: getattr(self, name).model_dump(mode="json") for name in FIXED_SECTIONS}
        for section, spec in self.components.items():
            data[section] = spec.to_dict()
        return data


# -- reading -----------------------------------------------------------------


CONFIG_MAX_BYTES = 4 << 20
"""A config is a page of TOML; a file past this is something else (a log, a dataset), read no further."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file, one that is not a regular file (a FIFO, a device, a folder), one past
    :data:`CONFIG_MAX_BYTES` or a syntax error is one :class:`Problem`."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # before opening: a FIFO would block, /dev/zero never ends
            raise ConfigError([Problem("", f"cannot read {path}: not a regular file")])
        with path.open("rb") as file:
            raw = file.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read {path}: {exc.strerror or exc}")]) from None
    except ValueError:  # a NUL in the path
        raise ConfigError([Problem("", f"cannot read {path!r}: a path holds no NUL character")]) from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise ConfigError([Problem("", f"{path} is over {CONFIG_MAX_BYTES >> 20} MiB: not a config")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML is UTF-8 (a file saved as Latin-1 or UTF-16, a binary file)
        byte = exc.object[exc.start:exc.start + 1]
        problem = Problem("", f"{path} is not UTF-8 text (byte {exc.start}: {byte!r}); TOML files are UTF-8")
        raise ConfigError([problem]) from None
    if path.suffix == ".json":  # a run's config.resolved.json, as the role processes read it
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError([Problem("", f"{path}: JSON syntax error: {exc}")]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([Problem("", f"{path}: TOML syntax error: {exc}")]) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as TOML, else taken as a string)."""
    problems = []
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        keys = [k.strip() for k in dotted.split(".")]
        if not sep or len(keys) < 2 or not all(keys):
            problems.append(Problem(f"--set {item}", "expected section.key=value"))
            continue
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        table = data
        for key in keys[:-1]:
            nested = table.setdefault(key, {})
            if not isinstance(nested, dict):
                problems.append(Problem(f"--set {item}", f"{key!r} is not a table"))
                break
            table = nested
        else:
            table[keys[-1]] = value
    if problems:
        raise ConfigError(problems)
    return data


def load_config(
    path: str | Path, overrides: Sequence[str] = (), plugins: Plugins | None = None
) -> tuple[RunConfig, Plugins]:
    """Read, override and validate a plugins.toml; load the plugins it asks for.

    :raises ConfigError: with every problem found.
    """
    data = apply_overrides(read_toml(path), overrides)
    nuls = [Problem(key, "holds a NUL character (no file name or text takes one)") for key in _nul_keys(data)]
    if nuls:
        raise ConfigError(nuls)
    if plugins is None:
        disable = data.get("plugins", {}).get("disable", []) if isinstance(data.get("plugins"), dict) else []
        plugins = load_plugins(disable=[d for d in disable if isinstance(d, str)])
    config = validate(data, plugins)
    config.source = Path(path)
    return config, plugins


def _nul_keys(value: Any, key: str = "") -> Iterator[str]:
    """The dotted keys of the strings in ``value`` that hold a NUL (``"\\u0000"`` in TOML)."""
    if isinstance(value, str) and "\0" in value:
        yield key
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _nul_keys(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nul_keys(item, f"{key}[{i}]")


# -- validating --------------------------------------------------------------


def validate(data: dict[str, Any], plugins: Plugins) -> RunConfig:
    """Validate parsed TOML against the fixed sections and the registered components.

    :raises ConfigError: with every problem found, in file order.
    """
    problems: list[Problem] = []
    valid_sections = [*FIXED_SECTIONS, *SECTION_KINDS]
    fixed: dict[str, BaseModel] = {}
    components: dict[str, ComponentSpec] = {}
    for section, value in data.items():
        if section not in valid_sections:
            problems.append(
                Problem(
                    section,
                    f"unknown section{did_you_mean(section, valid_sections)}; "
                    f"valid sections: {', '.join(valid_sections)}",
                )
            )
            continue
        if not isinstance(value, dict):
            problems.append(Problem(section, f"must be a table ([{section}]), got {_type_name(value)}"))
            continue
        if section in FIXED_SECTIONS:
            model = _validate_model(FIXED_SECTIONS[section], value, section, problems)
            if model is not None:
                fixed[section] = model
        else:
            spec = validate_component(section, value, plugins, problems)
            if spec is not None:
                components[section] = spec
    config = RunConfig(**{name: fixed.get(name) or model() for name, model in FIXED_SECTIONS.items()},
                       components=components)
    problems.extend(cross_check(config))
    if problems:
        raise ConfigError(problems)
    return config


def cross_check(config: RunConfig) -> list[Problem]:
    """Contradictions between sections: every configured component's optional ``check_config(config, run)``.

    Sections that failed their own validation are absent from ``config``, so a
    check sees only valid sections and never repeats their problems.
    """
    problems: list[Problem] = colocation_problems(config)
    for spec in config.components.values():
        check = getattr(spec.component.cls, "check_config", None)
        if callable(check):
            problems.extend(_checked(spec, check, config))
    return problems


def _checked(spec: ComponentSpec, check, config: RunConfig) -> list[Problem]:
    """What ``spec``'s ``check_config`` finds; a check that raises or returns something else than problems is
    a problem of that plugin, named (it was an "internal error", or "error: None")."""
    where = f"{spec.section}.use"
    plugin = f"{spec.kind} {spec.name!r} ({spec.component.provider})"
    try:
        found = check(spec.config, config)
    except I3Error:
        raise
    except Exception as exc:
        return [Problem(where, f"{plugin}: its check_config raised {exception_line(exc)}")]
    if not isinstance(found, list | tuple) or not all(isinstance(p, Problem) for p in found):
        return [Problem(where, f"{plugin}: its check_config returned {type(found).__name__}, not a list of "
                               "Problem")]
    return list(found)


def colocation_problems(config: RunConfig) -> list[Problem]:
    """``[trainer] colocate`` needs one rank beside the ``local`` engine, with the same torch thread count (torch's
    threads are the process's)."""
    trainer, inference = config.trainer, config.get("inference")
    if not trainer.colocate:
        return []
    problems = []
    if trainer.nproc != 1:
        problems.append(Problem("trainer.colocate", f"runs one trainer rank in the run's process; nproc is "
                                                    f"{trainer.nproc}"))
    if inference is not None and inference.name != "local":
        problems.append(Problem("trainer.colocate", f'shares the run\'s process with the engine of inference "local";'
                                                    f' this run\'s is "{inference.name}" (its servers are processes '
                                                    "of their own)"))
    elif inference is not None and inference.config.threads != trainer.threads:
        problems.append(Problem("trainer.colocate", f"torch's thread count is the process's: trainer.threads "
                                                    f"({trainer.threads}) and inference.threads "
                                                    f"({inference.config.threads}) must be equal"))
    return problems


def validate_component(
    section: str, value: dict[str, Any], plugins: Plugins, problems: list[Problem]
) -> ComponentSpec | None:
    return _validate_named(SECTION_KINDS[section].name, section, value, plugins, problems)


def build_component(section: str, value: dict[str, Any], plugins: Plugins) -> Any:
    """The component of ``section`` that ``value`` (``{"use": name, **options}``) names, built as ``cls(config)``.

    :raises ConfigError: an unknown name or invalid options, every problem listed.
    """
    problems: list[Problem] = []
    spec = validate_component(section, value, plugins, problems)
    if spec is None:
        raise ConfigError(problems)
    return spec.build()


def _validate_named(kind_name: str, section: str, value: dict[str, Any], plugins: Plugins,
                    problems: list[Problem]) -> ComponentSpec | None:
    """Validate ``{"use": name, **options}`` as a component of ``kind_name``; problems under ``section``."""
    kind = KINDS[kind_name]
    available = plugins.registry.of_kind(kind.name)
    choices = ", ".join(f"{c.name} ({c.provider.distribution})" for c in available) or "none installed"
    options = dict(value)
    name = options.pop("use", None)
    if name is None:
        problems.append(Problem(f"{section}.use", f"missing: pick a {kind.name}: {choices}"))
        return None
    if not isinstance(name, str):
        problems.append(Problem(f"{section}.use", f"must be a string naming a {kind.name}, got {_type_name(name)}"))
        return None
    component = plugins.registry.get(kind.name, name)
    if component is None:
        problems.append(
            Problem(
                f"{section}.use",
                f"unknown {kind.name} {name!r}{did_you_mean(name, plugins.registry.names(kind.name))}; "
                f"available: {choices}{plugins.failure_hint()}",
            )
        )
        return None
    config = _validate_model(component.config_model, options, section, problems)
    if config is None:
        return None
    before = len(problems)
    _validate_refs(config, section, plugins, problems)
    return ComponentSpec(section, component, config) if len(problems) == before else None


def _validate_refs(config: BaseModel, section: str, plugins: Plugins, problems: list[Problem]) -> None:
    """Validate every :class:`ComponentRef` in ``config``'s fields (alone or in a list) and attach its spec."""
    for name in type(config).model_fields:
        value = getattr(config, name)
        refs = [(f"{section}.{name}", value)] if isinstance(value, ComponentRef) else [
            (f"{section}.{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, ComponentRef)
        ] if isinstance(value, list) else []
        for path, ref in refs:
            ref._spec = _validate_named(ref.kind, path, {"use": ref.use, **ref.options}, plugins, problems)


def _validate_model(
    model: type[BaseModel], value: dict[str, Any], section: str, problems: list[Problem]
) -> BaseModel | None:
    infinite = list(_non_finite(value, section))
    if infinite:  # TOML's inf and nan: no setting means them (an lr of inf trains NaN weights)
        problems.extend(Problem(path, f"must be a finite number, got {number}") for path, number in infinite)
        return None
    try:
        validated = model.model_validate(value)
    except pydantic.ValidationError as exc:
        for error in exc.errors(include_url=False):
            problems.append(_problem_from_pydantic(model, section, error))
        return None
    numbers = list(_booleans_as_numbers(value, validated, section))
    if numbers:  # pydantic reads true as 1 where a number is expected; in TOML it is a switch, not a count
        problems.extend(Problem(path, f"must be a number, got {str(flag).lower()} (a boolean)") for path, flag in numbers)
        return None
    return validated


def _non_finite(value: Any, path: str):
    """``(path, value)`` of every float in ``value`` (a section's dict, nested) that is inf or nan."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, f"{path}[{index}]")


def _booleans_as_numbers(value: Any, validated: Any, path: str):
    """``(path, value)`` of every boolean in ``value`` (a section's dict, nested) that validation made a number."""
    if isinstance(value, bool):
        if isinstance(validated, int | float) and not isinstance(validated, bool):
            yield path, value
    elif isinstance(value, dict) and isinstance(validated, BaseModel | dict):
        for key, item in value.items():
            found = validated.get(key) if isinstance(validated, dict) else getattr(validated, key, None)
            yield from _booleans_as_numbers(item, found, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(validated, list | tuple):
        for index, (item, found) in enumerate(zip(value, validated)):
            yield from _booleans_as_numbers(item, found, f"{path}[{index}]")


def _problem_from_pydantic(model: type[BaseModel], section: str, error: dict[str, Any]) -> Problem:
    loc = tuple(error["loc"])
    path = section + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    if error["type"] == "extra_forbidden":
        key = str(loc[-1])
        valid = _fields_at(model, loc[:-1])
        keys = ", ".join(valid) if valid else "none"
        return Problem(path, f"unknown key{did_you_mean(key, valid)}; valid keys: {keys}")
    message = error["msg"].removeprefix("Value error, ")  # a model validator's own sentence says enough
    if error["type"] != "missing" and "input" in error and not isinstance(error["input"], dict):
        message += f", got {error['input']!r}"
    return Problem(path, message)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the (nested) model at ``loc``, as far as it can be followed."""
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        nested = _model_in(info.annotation) if info is not None else None
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _type_name(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), type(value).__name__)


# -- schema ------------------------------------------------------------------


def json_schema(plugins: Plugins) -> dict[str, Any]:
    """JSON Schema of plugins.toml for the components the loaded plugins provide."""
    fields: dict[str, Any] = {name: (model, None) for name, model in FIXED_SECTIONS.items()}
    for section, kind in SECTION_KINDS.items():
        members = []
        for component in plugins.registry.of_kind(kind.name):
            members.append(
                pydantic.create_model(
                    _identifier(f"{kind.name}_{component.name}"),
                    __base__=component.config_model,
                    __doc__=(component.cls.__doc__ or component.config_model.__doc__ or "").strip() or None,
                    use=(Literal[component.name], Field(description=f"Use {kind.name} {component.name!r}.")),
                )
            )
        if len(members) == 1:
            fields[section] = (members[0] | None, None)
        elif members:
            union = Annotated[Union[tuple(members)], Field(discriminator="use")]  # noqa: UP007
            fields[section] = (union | None, None)
    file_model = pydantic.create_model(
        "PluginsToml", __config__=ConfigDict(extra="forbid", title="plugins.toml"), **fields
    )
    return file_model.model_json_schema()


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text)


TRAINING_SECTIONS = ("model", "inference", "env")
"""Sections the training loop needs; the others have defaults."""
DEFAULT_SECTIONS = {
    "loss": "icepop",
    "optimizer": "adamw",
    "scheduler": "async",
    "weight_sync": "filesystem",
    "metrics": "jsonl",
}
"""Components a training run uses when their section is absent."""


def with_defaults(config: RunConfig, plugins: Plugins) -> RunConfig:
    """Fill absent sections of a training run with :data:`DEFAULT_SECTIONS`."""
    if any(config.get(s) is None for s in TRAINING_SECTIONS):
        return config
    data = config.to_dict()
    for section, name in DEFAULT_SECTIONS.items():
        data.setdefault(section, {"use": name})
    resolved = validate(data, plugins)
    resolved.source = config.source
    return resolved
