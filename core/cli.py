"""The ``i3core`` command: parse, build, run, close. Errors are one line and a non-zero exit."""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from i3core import __version__
from i3core.errors import ConfigError, I3Error

DEBUG_ENV = "I3CORE_DEBUG"
"""Set to 1 to let unexpected exceptions show their traceback."""


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
    trainer.set_defaults(func=cmd_trainer)

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
    evaluate.add_argument("--n", type=int, default=20, help="dataset rows to roll out (the first N)")
    evaluate.add_argument("--rollouts-per-example", type=int, default=1, help="rollouts of each row (a group)")
    evaluate.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once")
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
    from i3core import log, run
    from i3core.config import load_config

    config, plugins = load_config(args.config, args.overrides)
    log.configure(level=args.log_level, json_path=config.run.out / "logs" / "run.jsonl")
    return run.execute(config, plugins)


def cmd_trainer(args: argparse.Namespace) -> int:
    from i3core import trainer

    return trainer.main([str(args.config), *(f"--set={o}" for o in args.overrides)])


def cmd_check(args: argparse.Namespace) -> int:
    from i3core.config import load_config

    config, _ = load_config(args.config, args.overrides)
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


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from i3core.scaffold import new_plugin

    root = new_plugin(args.name, args.dir, kind=args.kind)
    print(f"created {root}: pip install -e '{root}[test]' && pytest {root}")
    return 0


def cmd_env_eval(args: argparse.Namespace) -> int:
    from i3core.evaluate import run_eval

    result, env_name = run_eval(args)
    summary = result.summary()
    if args.json:
        print(json.dumps({"env": env_name, **summary, "errors": result.failed[:10]}, indent=2))
        return 0 if result.rollouts else 1
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
    return 0 if result.rollouts else 1


def _completion_preview(rollout, limit: int = 120) -> str:
    completion = rollout.state.get("completion")
    if isinstance(completion, list):
        text = " | ".join(f"{m['role']}: {m.get('content') or ''}" for m in completion)
    else:
        text = rollout.completion_text
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from i3core import log

    log.configure(level=args.log_level)
    try:
        return args.func(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        count = len(exc.problems)
        print(f"{count} problem{'s' if count != 1 else ''} in {getattr(args, 'config', 'the config')}", file=sys.stderr)
        return exc.exit_code
    except I3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
