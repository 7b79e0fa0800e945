"""The ``i3core`` command: parse, build, run, close. Errors are one line and a non-zero exit."""

import argparse
import faulthandler
import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from i3core import __version__
from i3core.errors import ConfigError, HookFailed, I3Error

DEBUG_ENV = "I3CORE_DEBUG"
"""Set to 1 to let unexpected exceptions show their traceback."""


def _whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number of at least ``minimum`` (and at most ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


positive_int = _whole_number(1)
non_negative_int = _whole_number(0)
MAX_PORT = 65535
"""TCP ports are 16 bits."""
port_number = _whole_number(1, MAX_PORT)
listen_port = _whole_number(0, MAX_PORT)
"""A port to listen on; 0: any free one."""
MAX_NODES = 1 << 20
"""More nodes than any cluster has (Fugaku: 158,976): a larger count is a typo."""
node_count = _whole_number(1, MAX_NODES)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="path to a plugins.toml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (TOML syntax, e.g. --set loss.mask_high=4.0); repeatable",
    )


def _add_agent_args(parser: argparse.ArgumentParser) -> None:
    from i3core.sandbox.base import AGENT_LIMITS, AGENT_TOKEN_ENV, AGENT_UID, SandboxConfig

    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-pid", type=int, help="host pid of the process whose namespaces commands join")
    target.add_argument("--target-match", metavar="REGEX", help="the target is the first (lowest pid) process whose "
                        "command line (arguments joined by spaces) matches REGEX (re.search)")  # fmt: skip
    parser.add_argument("--target-wait-s", type=float, default=60.0, help="how long to wait for --target-match")
    parser.add_argument("--host", default="0.0.0.0", help="address to serve on")
    parser.add_argument("--port", type=int, default=8080, help="port to serve on (0: any free port)")
    parser.add_argument("--token-env", default=AGENT_TOKEN_ENV, help="environment variable holding the bearer token")
    parser.add_argument("--sandbox-id", default=socket.gethostname(), help="id reported in the readiness POST")
    parser.add_argument("--advertise", metavar="HOST:PORT", help="address reported in the readiness POST "
                        "(default: --host and the bound port)")  # fmt: skip
    parser.add_argument("--ready-url", help="URL to POST {sandbox, address} to once serving (none: no POST)")
    parser.add_argument("--uid", type=int, default=AGENT_UID, help="uid commands run as (not the target's own)")
    parser.add_argument("--gid", type=int, default=AGENT_UID, help="gid commands run as")
    defaults = SandboxConfig()
    for name in AGENT_LIMITS:  # none is a bool: type=bool would read "False" as True
        default = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=SandboxConfig.model_fields[name].description)  # fmt: skip


def _add_resume(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its newest "
                        "complete checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="i3core",
        description="Asynchronous, agentic RL post-training, one plugin per strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"i3core {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="console log level"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run every role of plugins.toml on this machine", description="Validate the "
                              "config, build every component and run the training job.")
    _add_config_args(run)
    _add_resume(run)
    run.set_defaults(func=cmd_run)

    check = commands.add_parser("check", help="validate plugins.toml only (exit 2 on problems)",
                                description="Validate a config and list every problem; builds nothing.")
    _add_config_args(check)
    check.set_defaults(func=cmd_check)

    plugins = commands.add_parser("plugins", help="list loaded plugins, their hooks and components",
                                  description="Every installed plugin with its distribution, version, "
                                  "hooks and components.")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(func=cmd_plugins)

    schema = commands.add_parser("schema", help="print the JSON Schema of plugins.toml",
                                 description="JSON Schema of plugins.toml for the installed plugins.")
    schema.add_argument("--indent", type=int, default=2, help="JSON indentation")
    schema.set_defaults(func=cmd_schema)

    trainer = commands.add_parser("trainer", help="the trainer role alone (run it under torchrun)",
                                  description="Run only the trainer; `i3core run` starts it for you.")
    _add_config_args(trainer)
    trainer.add_argument("--resume", action="store_true", help="continue the run in output_dir from its newest "
                         "complete checkpoint (none: start it over), undoing what it did after it")
    trainer.set_defaults(func=cmd_trainer)

    agent = commands.add_parser("sandbox-agent", help="serve one sandbox's HTTP API (the Kubernetes sidecar)",
                                description="Run commands inside a target process's namespaces, over the HTTP API "
                                "of docs/sandboxes.md; the bearer token comes from an environment variable.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_agent_args(agent)
    agent.set_defaults(func=cmd_sandbox_agent)

    sandbox = commands.add_parser("sandbox", help="sandbox backend tools (see docs/sandboxes.md)",
                                  description="Tools for the [sandbox] backend of a config.")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND",
                                              help="what to do with the [sandbox] backend")
    manifests = sandbox_commands.add_parser(
        "manifests", help="print the Kubernetes objects a run's sandboxes need, for kubectl apply -f -",
        description="Build the [sandbox] backend of plugins.toml and print its manifests() (the k8s backend: "
                    "token Secret, headless Service, NetworkPolicy, a sample sandbox Pod).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    _add_config_args(manifests)
    manifests.add_argument("--format", choices=["yaml", "json"], default="yaml",
                           help="YAML documents (needs PyYAML, in the k8s extra) or one JSON `kind: List`")
    manifests.set_defaults(func=cmd_sandbox_manifests)

    plot = commands.add_parser("plot", help="plot a run's metrics.jsonl (PNGs and an HTML summary)",
                               description="Write plot.png, one PNG per view (reward, loss, off-policy steps, "
                               "mismatch KL, masked fractions, throughput) and index.html.")
    plot.add_argument("run_dir", type=Path, help="a run's output directory (holds metrics.jsonl)")
    plot.add_argument("--out", type=Path, default=None,
                      help="folder for the PNGs and index.html (default: RUN_DIR/plots)")
    plot.set_defaults(func=cmd_plot)

    rollouts = commands.add_parser("rollouts", help="print a run's rollouts of one step (rollouts/step_N.jsonl)",
                                   description="Each rollout of a step as its env scored it: prompt, completion, "
                                   "reward, advantage, finish reason, ledger outcome, token counts and versions.")
    rollouts.add_argument("run_dir", type=Path, help="a run's output directory (holds rollouts/)")
    rollouts.add_argument("--step", type=positive_int, default=None, help="which step (default: the newest kept)")
    rollouts.add_argument("--limit", type=positive_int, default=None, help="print at most this many rollouts")
    rollouts.set_defaults(func=cmd_rollouts)

    inference = commands.add_parser("inference", help="one inference server of the run (for clusters)",
                                    description="Wait for the trainer's version 0 in the shared output_dir, then "
                                    "become server INDEX of the [inference] rollout source.")
    _add_config_args(inference)
    inference.add_argument("--index", type=non_negative_int, default=0,
                           help="this server's index among the run's servers (0 .. [inference] servers - 1)")
    inference.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    inference.add_argument("--host", default=None, help="address to listen on (default: [inference] host)")
    inference.add_argument("--resume", action="store_true", help="serve the version the trainer's attempt started "
                           "from (its marker in output_dir; $I3CORE_ATTEMPT names the attempt) instead of version 0")
    inference.set_defaults(func=cmd_inference)

    serve = commands.add_parser("serve", help="serve a saved model directory over the OpenAI API (like vllm serve)",
                                description="The builtin inference server alone on DIR (config.json, safetensors, "
                                "tokenizer): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, vLLM's "
                                "/inference/v1/generate, and i3core's weight endpoints. See docs/serving.md.")
    serve.add_argument("model_dir", type=Path, metavar="DIR", help="the model directory (save_hf / save_pretrained)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=listen_port, default=8000, help="port to listen on (0: any free port)")
    serve.add_argument("--max-slots", type=int, default=64, help="sequences decoded together")
    serve.add_argument("--max-len", type=int, default=2048, help="longest prompt + completion, in tokens")
    serve.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    serve.add_argument("--model", default="tiny-moe", metavar="NAME",
                       help="the [model] component that reads DIR (any installed model plugin)")
    serve.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an option of that component (repeatable; values parse as TOML)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send and responses echo (default: DIR)")
    serve.add_argument("--lora", type=Path, default=None, metavar="ADAPTER_DIR",
                       help="serve this LoRA adapter (PEFT's directory, e.g. a run's version or `i3core export`) on "
                            "the base DIR; /update_weights then takes adapter versions (default: DIR alone)")
    serve.add_argument("--api-key", default=None,
                       help="a Bearer token /v1/* asks for, as vLLM's --api-key (default: $I3CORE_API_KEY; none: open)")
    serve.add_argument("--enable-admin", action="store_true",
                       help="serve the admin routes (/update_weights, /pause, /resume, sessions); they ask for "
                            "--admin-token (default: off, 404)")
    serve.add_argument("--admin-token", default=None,
                       help="the Bearer token the admin routes ask for (default: $I3CORE_ADMIN_TOKEN)")
    serve.add_argument("--weights-root", type=Path, action="append", default=[], metavar="DIR",
                       help="a directory /update_weights may load from (repeatable; default: DIR's parent)")
    serve.add_argument("--shutdown-grace-s", type=seconds, default=5.0,
                       help="on SIGTERM/SIGINT, seconds requests in flight may take before they get a 503")
    serve.set_defaults(func=cmd_serve)

    export = commands.add_parser("export", help="a run's checkpoint as a model directory (the adapter, or merged)",
                                 description="Write checkpoint N of the run in RUN_DIR to OUT: a LoRA run's adapter "
                                 "as PEFT writes it, or with --merge the base with the adapter merged (a plain "
                                 "transformers directory); a full fine-tuning run's weights as an HF directory.")
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's output_dir")
    export.add_argument("--step", type=positive_int, required=True, help="the checkpoint (checkpoints/step_N)")
    export.add_argument("--merge", action="store_true", help="merge the adapter into the base's weights")
    export.add_argument("out", type=Path, metavar="OUT", help="the directory to write (new or empty)")
    export.set_defaults(func=cmd_export)

    orchestrator = commands.add_parser("orchestrator", help="the orchestrator alone, on given servers (for clusters)",
                                       description="Drive rollouts on the given inference servers and feed the "
                                       "trainer through the shared output_dir.")
    _add_config_args(orchestrator)
    orchestrator.add_argument("--servers", nargs="+", required=True, metavar="URL",
                              help="base URLs of the inference servers (http://host:port)")
    orchestrator.add_argument("--resume", action="store_true", help="continue from the checkpoint the trainer's "
                              "attempt started from (its marker in output_dir; $I3CORE_ATTEMPT names the attempt): "
                              "state, ledger and prompt stream restored")
    orchestrator.set_defaults(func=cmd_orchestrator)

    launch = commands.add_parser("launch", help="render, or submit to Slurm, the cluster job of the three roles",
                                 description="Render the packaged Slurm or Kubernetes templates from plugins.toml "
                                 "(trainer under torchrun, one inference server per node, the orchestrator on a CPU "
                                 "node, every role started with --resume) and print them (--dry-run) or submit the "
                                 "Slurm job with sbatch (--submit). See docs/deploy.md.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    launch.add_argument("config", type=Path, help="path to a plugins.toml")
    mode = launch.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="render only: print the files, or write them to --out")
    mode.add_argument("--submit", action="store_true", help="Slurm: write the job script into the run's output_dir "
                      "and submit it with sbatch; prints the job id and where its logs are")
    launch.add_argument("--resume", action="store_true", help="--submit into an output_dir that holds an earlier "
                        "run: continue it from its newest checkpoint (without it such a directory is refused)")
    launch.add_argument("--target", choices=["slurm", "k8s"], default="slurm", help="what to render for")
    launch.add_argument("--out", type=Path, default=None, help="--dry-run: folder to write the files to "
                        "(default: stdout)")
    nodes = launch.add_argument_group("node shapes")
    nodes.add_argument("--trainer-nodes", type=node_count, default=1, help="trainer nodes (torchrun --nnodes)")
    nodes.add_argument("--inference-nodes", type=node_count, default=None,
                       help="inference nodes, one server each (default: [inference] servers)")
    nodes.add_argument("--gpus-per-node", type=non_negative_int, default=8,
                       help="GPUs per trainer/inference node; 0: CPU nodes (no GPU asked for, gloo)")
    nodes.add_argument("--procs-per-node", type=positive_int, default=None,
                       help="trainer ranks a node (torchrun --nproc-per-node; default: --gpus-per-node, or 1 on "
                       "CPU nodes)")
    nodes.add_argument("--orchestrator-cpus", type=positive_int, default=16, help="CPUs of the orchestrator's node")
    nodes.add_argument("--inference-port", type=port_number, default=8000, help="port every server listens on")
    nodes.add_argument("--rdzv-port", type=port_number, default=29500, help="torchrun's rendezvous port")
    slurm = launch.add_argument_group("Slurm")
    slurm.add_argument("--partition", default="gpu", help="partition of the trainer and inference nodes")
    slurm.add_argument("--cpu-partition", default="cpu", help="partition of the orchestrator's node")
    slurm.add_argument("--time", default=None, help="the job's time limit (sbatch --time, e.g. 2-00:00:00)")
    slurm.add_argument("--account", default=None, help="the account charged (sbatch --account)")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                       help="one more #SBATCH option of the job, e.g. --sbatch=--qos=high; repeatable")
    slurm.add_argument("--signal-grace", dest="signal_grace_s", type=positive_int, default=120,
                       help="seconds before the time limit the job gets SIGTERM (the trainer checkpoints, the job "
                       "requeues itself)")
    k8s = launch.add_argument_group("Kubernetes")
    k8s.add_argument("--image", default="i3core:latest", help="container image with i3core")
    k8s.add_argument("--namespace", default="default", help="namespace of every object")
    k8s.add_argument("--storage", default="100Gi", help="size of the shared ReadWriteMany volume")
    k8s.add_argument("--restarts", type=non_negative_int, default=10,
                     help="restarts of a role's pod before the run fails (the Jobs' backoffLimit)")
    launch.add_argument("--templates", type=Path, default=None,
                        help="a folder holding slurm/ and k8s/ templates (default: the ones in the package)")
    launch.set_defaults(func=cmd_launch)

    new = commands.add_parser("new-plugin", help="scaffold a pip-installable plugin package",
                              description="Write i3-plugin-NAME/ with an entry point, one component "
                              "(a loss or an environment) and its tests.")
    new.add_argument("name", help="plugin name, lowercase with dashes (e.g. my-loss)")
    new.add_argument("--kind", choices=("loss", "env"), default="loss", help="what the plugin provides")
    new.add_argument("--dir", type=Path, default=Path("."), help="folder to create the package in")
    new.set_defaults(func=cmd_new_plugin)

    env = commands.add_parser("env", help="environment tools (eval)", description="Work with environments.")
    env_commands = env.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND",
                                      help="what to do with an environment")
    evaluate = env_commands.add_parser(
        "eval", help="run an env against an inference server and print its rewards",
        description="Roll out the first N rows of an env through an inference server and print each "
                    "rollout's reward and the means: the smoke test of an env. Without --server, a builtin "
                    "server is started on --model-dir (default: freshly initialised weights).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    evaluate.add_argument("env", help="a registered env name, or a plugins.toml whose [env] (and [model]) to use")
    evaluate.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                          help="an env option (TOML value, e.g. --set max_turns=3); repeatable")
    evaluate.add_argument("--n", type=positive_int, default=20, help="dataset rows to roll out (the first N)")
    evaluate.add_argument("--rollouts-per-example", type=positive_int, default=1, help="rollouts of each row (a group)")
    evaluate.add_argument("--concurrency", type=positive_int, default=8, help="rollouts in flight at once")
    evaluate.add_argument("--server", default=None, help="base URL of a running server (builtin or vLLM)")
    evaluate.add_argument("--model", default="tiny-moe", help="model component: its tokenizer, and its weights "
                          "when a server is started here")
    evaluate.add_argument("--model-dir", type=Path, default=None, help="HF weights for the server started here")
    evaluate.add_argument("--max-len", type=int, default=512, help="max_len of the server started here")
    evaluate.add_argument("--sandbox", default=None, help="sandbox backend for envs that run code (e.g. local)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of freshly initialised weights and of the "
                          "order an env group draws its members in")
    evaluate.add_argument("--show", type=int, default=5, help="rollouts printed in full (their completion)")
    evaluate.add_argument("--json", action="store_true", help="print the summary as JSON")
    evaluate.set_defaults(func=cmd_env_eval)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from i3core.cli import log
    from i3core.config import load_config, with_defaults
    from i3core.loop import run

    config, plugins = load_config(args.config, args.overrides)
    config = with_defaults(config, plugins)  # a contradiction with a default section: exit 2, nothing written
    log.configure(level=args.log_level, json_path=config.run.out / "logs" / "run.jsonl")
    return run.execute(config, plugins, resume=args.resume)


def cmd_trainer(args: argparse.Namespace) -> int:
    from i3core.loop import trainer
    from i3core.loop.resume import refuse_fresh_start_over

    config, _ = _role_config(args)
    if not args.resume:  # a fresh trainer would retrain the run's batches over its checkpoints
        refuse_fresh_start_over(config.run.out)
    return trainer.main([str(args.config), *(f"--set={o}" for o in args.overrides), *["--resume"] * args.resume],
                        config=config)


def cmd_sandbox_agent(args: argparse.Namespace) -> int:
    from i3core.sandbox import agent as sandbox_agent

    return sandbox_agent.main(args)


def _role_config(args: argparse.Namespace):
    from i3core.config import load_config
    from i3core.config import with_defaults

    config, plugins = load_config(args.config, args.overrides)
    return with_defaults(config, plugins), plugins


def cmd_inference(args: argparse.Namespace) -> int:
    from i3core.loop import roles

    config, _ = _role_config(args)
    return roles.serve(config, args.index, args.port, args.host, resume=args.resume)


def cmd_serve(args: argparse.Namespace) -> int:
    """Check everything a user can get wrong here, then become the server (replaces this process)."""
    import tomllib

    from i3core.config import build_component
    from i3core.manager import load_plugins
    from i3core.weights import check_max_len

    config_json = args.model_dir / "config.json"
    if not config_json.is_file():
        raise I3Error(f"{args.model_dir} is not a model directory (no config.json)")
    try:
        parsed = json.loads(config_json.read_bytes())
    except (OSError, ValueError):
        parsed = {}  # unreadable, or not JSON at all: the server says which, naming the file
    if not isinstance(parsed, dict):
        raise I3Error(f"{config_json} is not a model's config: its JSON is not an object")
    check_max_len(args.model_dir, args.max_len)  # as vLLM: more than the model's positions is refused (exit 2)
    options = {}
    for item in args.model_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise I3Error(f"--model-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            options[key] = value  # a bare string
    plugins = load_plugins()
    weights = args.model_dir
    if args.lora is not None:  # the base is DIR, given to the component as its `path`; the adapter goes on it
        if not (args.lora / "adapter_config.json").is_file():
            raise I3Error(f"--lora {args.lora} is not an adapter directory (no adapter_config.json)")
        options.setdefault("path", str(args.model_dir.resolve()))
        weights = args.lora
    model = {"use": args.model, **options}
    build_component("model", model, plugins)  # an unknown component or a bad option: exit 2, one line each
    source = build_component("inference", {"use": "builtin", "servers": 1, "host": args.host, "restarts": 0,
                                           "max_slots": args.max_slots, "max_len": args.max_len,
                                           "threads": args.threads, "served_model_name": args.served_model_name},
                             plugins)
    cmd = source.command(0, args.port, weights.resolve(), 0, None, model)
    cmd += ["--log-format", "console", "--shutdown-grace-s", str(args.shutdown_grace_s),
            *(f"--weights-root={root.resolve()}" for root in args.weights_root)]
    # secrets travel in the environment, not on a command line every user of the machine can read
    from i3core.lifetime import ADMIN_TOKEN_ENV, API_KEY_ENV

    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key
    if args.admin_token:
        os.environ[ADMIN_TOKEN_ENV] = args.admin_token
    if not args.enable_admin:
        cmd.append("--no-admin")
    elif not os.environ.get(ADMIN_TOKEN_ENV):
        raise I3Error(f"--enable-admin needs a token: give --admin-token or set ${ADMIN_TOKEN_ENV}")
    os.execv(cmd[0], cmd)  # the server says where it listens once it does


def cmd_export(args: argparse.Namespace) -> int:
    from i3core.cli.export import export

    path = export(args.run_dir, args.step, args.out, merge=args.merge)
    print(f"i3core export: step {args.step} of {args.run_dir} -> {path}", file=sys.stderr)
    return 0


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from i3core.cli import log
    from i3core.loop import roles
    from i3core.loop.resume import refuse_fresh_start_over

    config, plugins = _role_config(args)
    if not args.resume:  # a fresh orchestrator would write its batches and metrics over the run's
        refuse_fresh_start_over(config.run.out)
    log.configure(level=args.log_level, json_path=config.run.out / "logs" / "orchestrator.jsonl")
    return roles.orchestrate(config, plugins, args.servers, resume=args.resume)


def cmd_check(args: argparse.Namespace) -> int:
    from i3core.config import load_config
    from i3core.config import with_defaults

    config, plugins = load_config(args.config, args.overrides)
    config = with_defaults(config, plugins)  # checked as `i3core run` would run it
    used = ", ".join(f"{section}={spec.name}" for section, spec in config.components.items()) or "no components"
    print(f"{args.config}: OK ({used})")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from i3core.manager import load_plugins

    plugins = load_plugins()
    infos = plugins.info()
    if args.json:
        report = {
            "plugins": [asdict(info) for info in infos],
            "failed": [asdict(failure) for failure in plugins.failures],
            "blocked": plugins.blocked,
        }
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("plugin", "distribution", "version", "components", "hooks")
    for info in infos:
        components = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in info.components.items())
        table.add_row(info.name, info.distribution, info.version, components, "\n".join(info.hooks))
    console = Console()
    console.print(table)
    for failure in plugins.failures:
        console.print(f"[yellow]warning:[/] {failure}")
    for name in plugins.blocked:
        console.print(f"blocked: {name}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from i3core.config import json_schema
    from i3core.manager import load_plugins

    print(json.dumps(json_schema(load_plugins()), indent=args.indent))
    return 0


class UsageError(I3Error):
    """The command does not apply to this config (exit 2, like a config problem)."""

    exit_code = 2


def cmd_sandbox_manifests(args: argparse.Namespace) -> int:
    from i3core.config import load_config

    config, _ = load_config(args.config, args.overrides)
    spec = config.get("sandbox")
    if spec is None:
        raise UsageError(f"{args.config} has no [sandbox] section: nothing to print")
    backend = spec.build()
    if not callable(getattr(backend, "manifests", None)):
        raise UsageError(f"sandbox backend {spec.name!r} has no manifests (only backends that run on a cluster do)")
    items = backend.manifests()
    if args.format == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
        return 0
    try:
        import yaml
    except ImportError:
        raise UsageError("--format yaml needs PyYAML: pip install 'i3core[k8s]', or use --format json") from None
    print(yaml.safe_dump_all(items, sort_keys=False), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from i3core.loop.plot import plot_run

    written = plot_run(args.run_dir, args.out)
    print("\n".join(str(path) for path in written))
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    from i3core.loop.rollouts import read, render

    step, lines = read(args.run_dir, args.step)
    print(render(step, lines[: args.limit]), end="")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from i3core.cli.launch import Sizes, launch_files, submit, write
    from i3core.loop.resume import refuse_fresh_start_over

    if args.submit and args.target != "slurm":
        raise UsageError(f"--submit submits to Slurm; for --target {args.target} render with --dry-run --out DIR, "
                         "then kubectl apply -f DIR")
    if args.resume and not args.submit:
        raise UsageError("--resume goes with --submit (the rendered job always starts its roles with --resume)")
    config, _ = _role_config(argparse.Namespace(config=args.config, overrides=[]))
    sizes = Sizes(**{name: getattr(args, name) for name in Sizes.__dataclass_fields__})
    files = launch_files(config, args.config, args.target, sizes, args.templates)
    if args.dry_run:
        for path in write(files, args.out):
            print(path)
        return 0
    out = config.run.out.resolve()
    if not args.resume:
        refuse_fresh_start_over(out)
    job, output = submit(files, out)
    print(f"submitted job {job}: {out / next(iter(files))}")
    print(f"job output: {output}")
    print(f"role logs:  {out / 'logs'}/{{trainer,inference-*,orchestrator}}-{job}*.log")
    return 0


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from i3core.cli.scaffold import new_plugin

    root = new_plugin(args.name, args.dir, kind=args.kind)
    print(f"created {root}: pip install -e '{root}[test]' && pytest {root}")
    return 0


def cmd_env_eval(args: argparse.Namespace) -> int:
    from i3core.cli.evaluate import run_eval

    result, env_name = run_eval(args)
    summary = result.summary()
    # none came back (a server that does not answer, an env that always raises): one line says why
    nothing = None if result.rollouts else I3Error(
        f"all {len(result.failed)} rollouts of {env_name} failed; the first: {result.failed[0][1]}" if result.failed
        else f"no rollout of {env_name} came back")
    if args.json:
        print(json.dumps({"env": env_name, **summary, "errors": result.failed[:10]}, indent=2))
        if nothing is not None:
            raise nothing
        return 0
    if nothing is not None:
        raise nothing
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table("example", "task", "reward", "turns", "completion", title=f"{env_name}: first rollouts")
    for rollout in result.rollouts[: args.show]:
        table.add_row(rollout.example.id, rollout.example.task or "-", f"{rollout.reward:.3f}",
                      f"{rollout.metrics.get('turns', 1):g}", _completion_preview(rollout))
    console.print(table)
    for example_id, error in result.failed[:5]:
        console.print(f"[yellow]failed[/] {example_id}: {error}")
    for key, value in summary.items():
        console.print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}")
    return 0


def _completion_preview(rollout, limit: int = 120) -> str:
    completion = rollout.state.get("completion")
    if isinstance(completion, list):
        text = " | ".join(f"{m['role']}: {m.get('content') or ''}" for m in completion)
    else:
        text = rollout.completion_text
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    try:  # building the parser imports parts of the core: Ctrl-C there is an interrupt too
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    try:
        from i3core.cli import log

        log.configure(level=args.log_level)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack, to stderr
        return args.func(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        count = len(exc.problems)
        print(f"{count} problem{'s' if count != 1 else ''} in {getattr(args, 'config', 'the config')}", file=sys.stderr)
        return exc.exit_code
    except I3Error as exc:
        if isinstance(exc, HookFailed) and _debug():  # a plugin's bug: its author wants the traceback
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _debug():
            raise
        from i3core.files import disk_full  # imports torch: not before the command needs it

        if disk_full(exc):
            print(f"error: {_full_disk_line(args, exc)}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError):  # the user's files: a folder that cannot be written, a name too long ...
            print(f"error: {_os_error_line(exc)}", file=sys.stderr)
            return 1
        print(f"internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _os_error_line(exc: OSError) -> str:
    """What the system said and about which file(s): ``Permission denied: runs/x/logs``."""
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason}: {' -> '.join(names)}" if names else reason


def _full_disk_line(args: argparse.Namespace, exc: BaseException) -> str:
    """What a write on a full disk says: where, and the checkpoint to resume from when it is a run's."""
    from i3core.config import load_config
    from i3core.loop.checkpoint import full_disk_message

    try:
        config, _ = load_config(args.config, args.overrides)
    except (AttributeError, I3Error):
        return f"no space left on device: {exc}"
    return full_disk_message(config.run.out, exc)


if __name__ == "__main__":
    sys.exit(main())
