"""The commands over a run's folder: ``posttrain report`` (its report again), ``posttrain view``
(its recorded rollouts as one page) and ``posttrain diff`` (two configs side by side). Each
imports what it runs only when it runs, as the rest of the command line does."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_run_dir_commands(commands: Any, debug: argparse.ArgumentParser, commands_of_configs: list[str]) -> None:
    """The three subcommands on ``commands``; ``commands_of_configs``: how ``diff`` may read a config file."""
    report = commands.add_parser(
        "report", parents=[debug], help="rebuild report.html of a run directory from its files (finished or not)"
    )
    report.add_argument("run_dir", help="a run's output_dir, e.g. runs/reverse_grpo")
    report.set_defaults(handler=_report)
    view = commands.add_parser(
        "view",
        parents=[debug],
        help="one HTML page over a run's recorded rollouts: tokens, rewards, advantages, tool calls",
        description="Write RUN_DIR/rollouts.html (self-contained, no network) from what record_rollouts wrote "
        "under RUN_DIR/rollouts/, and print its path.",
    )
    view.add_argument("run_dir", help="a run's output_dir, e.g. runs/reverse_grpo")
    view.add_argument("--output", default=None, help="write the page here instead of RUN_DIR/rollouts.html")
    view.add_argument("--open", action="store_true", help="open the page in the default web browser")
    view.set_defaults(handler=_view)
    diff = commands.add_parser(
        "diff",
        parents=[debug],
        help="the config values two runs, config files or presets differ in",
        description="Compare two resolved configs key by key: a run folder (its config.yaml), a config file "
        "(resolved as --command's, defaults filled in) or an rl algorithm preset (e.g. grpo, dapo).",
    )
    diff.add_argument("a", help="a run folder, a config file or a preset")
    diff.add_argument("b", help="the same kinds")
    diff.add_argument(
        "--command", dest="read_as", choices=commands_of_configs, default="rl", help="how to read config files"
    )
    diff.set_defaults(handler=_diff)


def _diff(args: argparse.Namespace) -> int:
    from posttrain.train.config_view import comparable, differences, shown

    (first_name, first), (second_name, second) = comparable(args.a, args.read_as), comparable(args.b, args.read_as)
    rows = differences(first, second)
    print(f"[diff] {first_name} -> {second_name}: {len(rows)} value(s) differ")
    width = max((len(key) for key, _, _ in rows), default=0)
    for key, a, b in rows:
        print(f"  {key:<{width}}  {a if isinstance(a, str) and a == '(absent)' else shown(a)} -> "
              f"{b if isinstance(b, str) and b == '(absent)' else shown(b)}")  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    from posttrain.telemetry.report import rebuild_report

    folder = Path(args.run_dir)
    if not (folder / "metrics.jsonl").is_file() and not (folder / "report.json").is_file():
        from posttrain.errors import PosttrainError

        raise PosttrainError(f"{folder} is not a run directory (no metrics.jsonl): name the output_dir of a run")
    print(f"[report] {rebuild_report(folder)}")
    return 0


def _view(args: argparse.Namespace) -> int:
    from posttrain.view.rollout_view import write_view

    folder = Path(args.run_dir)
    if not folder.is_dir():
        from posttrain.errors import PosttrainError

        raise PosttrainError(f"{folder} is not a folder: name the output_dir of a run")
    path = write_view(folder, args.output)
    print(f"[view] {path}")
    if args.open:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())
    return 0
