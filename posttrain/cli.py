"""The `posttrain` command. Each subcommand imports its module only when it runs, so
`posttrain --help` answers without loading torch or transformers."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posttrain.run_commands import add_run_dir_commands

TRAINING_COMMANDS = {
    "sft": ("supervised fine-tuning (cold start) on prompt/completion or conversational data", "SFTRun", "run_sft"),
    "rm": ("train a Bradley-Terry reward model on preference pairs", "RewardModelRun", "run_reward_model"),
    "dpo": ("direct preference optimisation (sigmoid, ipo, hinge, robust)", "DPORun", "run_dpo"),
    "rl": ("online RL: GRPO, PPO, DAPO, RLOO, ... as presets of one loop (algorithm=NAME)", "RLRun", "run_rl"),
}


def algorithm_presets() -> list[str]:
    """Algorithm presets shipped in the package (``algorithm: NAME`` in an rl config)."""
    from importlib import resources

    return sorted(
        Path(item.name).stem for item in resources.files("posttrain.presets").iterdir() if item.name.endswith(".yaml")
    )


def preset_names() -> list[str]:
    """The YAML presets in ./configs (a checkout of posttrain ships them there)."""
    folder = Path("configs")
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _train(args: argparse.Namespace) -> int:
    from posttrain.config import describe, load_config

    _, config_name, runner_name = TRAINING_COMMANDS[args.command]
    if args.command == "rl":
        from posttrain.train import rl as runners
        from posttrain.train.rl_config import RLRun as config_cls
        from posttrain.train.rl_config import load_rl_config

        def load(cls: type, path: str | None, overrides: list[str]) -> object:
            return load_rl_config(path, overrides)
    else:
        from posttrain.train import recipes as runners

        config_cls = getattr(runners, config_name)
        load = load_config
    if (args.nproc_per_node or 1) > 1 and "WORLD_SIZE" not in os.environ and not args.options:
        from posttrain.launch import launch

        os.environ["POSTTRAIN_COMMAND"] = shlex.join(["posttrain", *args.argv])  # what a rank's message quotes
        return launch(without_option(args.argv, "--nproc-per-node"), args.nproc_per_node)
    if args.options or args.print_config:
        return _show_config(args, config_cls, describe)
    if args.resume is not None:
        args.overrides.append(f"resume={args.resume}")
    from posttrain.train.config_view import load_or_say_where_to_start

    def read() -> Any:
        return load(config_cls, args.config, args.overrides)

    config = load_or_say_where_to_start(args.command, args.config, read)
    args.output_dir = config.output_dir  # named by the Ctrl-C message
    from posttrain.run.run_header import run_header
    from posttrain.telemetry.headline import closing_lines
    from posttrain.train.rl_config import header_notes

    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun, one header and one ending
    if main_rank:
        notes = header_notes(args.command, args.config, args.overrides)
        print("\n".join(run_header(args.command, config, notes)), flush=True)
    from posttrain.plan.announce import announce_plan

    # every rank sizes its micro-batches alike; rank 0 prints the plan; a run that cannot fit stops here
    config = announce_plan(args.command, config, echo=main_rank)
    if args.plan:
        return 0
    from posttrain.run.out_of_memory import is_out_of_memory, out_of_memory

    out = Path(config.output_dir).absolute()  # where the run writes, whatever its user code does to the cwd
    try:
        getattr(runners, runner_name)(config)
    except Exception as error:  # out of memory: one message naming the stage and what to lower
        if not is_out_of_memory(error):
            raise
        raise out_of_memory(error, config) from error
    if main_rank:
        for line in closing_lines(out):
            print(f"[{args.command}] {line}")
        print(f"[{args.command}] done: model {config.output_dir}/final, report {config.output_dir}/report.html")
    return 0


# the repository's config each command can start from (what the README and docs/training.md run)


def _show_config(args: argparse.Namespace, config_cls: type, describe: Callable) -> int:
    """``--print-config``: the resolved config with origins; ``--options``: every key's default
    and meaning, or given a config, its resolved value and origin."""
    from posttrain.train.config_view import (
        layered_values,
        option_line,
        print_config_lines,
        resolved_with_origins,
        shown,
    )

    if args.print_config:
        print("\n".join(print_config_lines(*resolved_with_origins(args.command, args.config, args.overrides))))
        return 0
    # `--options kl`: bare words filter the keys; key=value words resolve the config as usual
    words = [item for item in args.overrides if "=" not in item]
    overrides = [item for item in args.overrides if "=" in item]
    given = layered_values(args.command, args.config, overrides)
    for key, default, doc in describe(config_cls):
        if words and not any(word in key for word in words):
            continue
        value, origin = given.get(key, (None, "default"))
        inside = {k[len(key) + 1 :]: v for k, v in given.items() if k.startswith(f"{key}.")}  # a free-form mapping
        if inside:
            value, origin = {k: v for k, (v, _) in inside.items()}, ", ".join(sorted({o for _, o in inside.values()}))
        value = default if origin == "default" else shown(value)
        print(option_line(f"{key:<34} {value:<22} " + ("" if not given else f"{origin:<18} "), doc))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from posttrain.eval_command import run_eval

    return run_eval(args)


def _demo(args: argparse.Namespace) -> int:
    from posttrain.demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(
            seed=args.seed,
            output_dir=args.output_dir,
            sft_max_steps=args.sft_max_steps,
            baseline=not args.no_baseline,
            threads=args.threads,
            rl=tuple(demo_rl_overrides(args)),
        )
    )
    return 0


def demo_rl_overrides(args: argparse.Namespace) -> list[str]:
    """The demo's RL flags as the overrides of its RL stage's config they stand for, then the
    ``key=value`` overrides given after them (the later win)."""
    flags = {
        "steps": args.rl_steps,
        "rollout.max_staleness": args.max_staleness,
        "rollout.interrupt": "true" if args.interrupt else None,
        "cluster.kind": "ray" if args.ray_workers else None,
        "cluster.rollout_workers": args.ray_workers or None,
    }
    return [f"{key}={value}" for key, value in flags.items() if value is not None] + list(args.overrides)


def _import_gguf(args: argparse.Namespace) -> int:
    from posttrain.models.gguf import describe, import_gguf

    try:
        folder = import_gguf(args.file, args.out_dir)
    except (ImportError, FileNotFoundError, ValueError) as error:
        print(f"posttrain models import-gguf: {error}", file=sys.stderr)
        return 2
    summary = ", ".join(f"{key} {value}" for key, value in describe(folder).items())
    print(f"[models] {args.file} -> {folder} ({summary}); load it with model.path={folder}")
    return 0


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # a dotted config key, then its value


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ ``low``, or argparse's one-line refusal naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from posttrain.train.config_view import EXAMPLE_CONFIG

    presets = ", ".join(preset_names()) or "(none found in ./configs)"
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-train language models: SFT, reward models, DPO and one RL loop.",
        epilog=f"run configs in ./configs: {presets}. Algorithm presets for `rl` (algorithm=NAME): "
        f"{', '.join(algorithm_presets())}. Example: posttrain rl --config configs/reverse_grpo.yaml algorithm=dapo",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one message")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    # --debug is accepted after the command too; SUPPRESS keeps the subcommand from resetting it
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for name, (summary, _, _) in TRAINING_COMMANDS.items():
        sub = commands.add_parser(
            name,
            parents=[debug],
            help=summary,
            description=f"{summary}. Options come from --config and "
            "dotted key=value overrides; --options lists them all.",
        )
        sub.add_argument("--config", help=f"a YAML config file (e.g. {EXAMPLE_CONFIG[name]})")
        sub.add_argument("--resume", help='"auto" (newest complete checkpoint in output_dir) or a checkpoint path')
        sub.add_argument(
            "--options",
            action="store_true",
            help="list every config key with its default and meaning (given --config or key=value: "
            "the value they resolve to, and where it comes from)",
        )
        sub.add_argument(
            "--print-config",
            action="store_true",
            help="print the resolved config (defaults, preset, --config, key=value), each value's origin; exit",
        )
        sub.add_argument(
            "--plan", action="store_true", help="print the run's memory per phase against the device's, then exit"
        )
        sub.add_argument(
            "--nproc-per-node",
            type=at_least(1),
            default=None,
            help="data parallel: run as N processes on this machine (as torchrun --standalone --nproc_per_node N)",
        )
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. steps=200 model.path=runs/sft/final")
        sub.set_defaults(handler=_train)
    _add_eval(commands, debug)
    add_run_dir_commands(commands, debug, list(TRAINING_COMMANDS))
    _add_models(commands, debug)
    _add_demo(commands, debug)
    return parser


def _add_eval(commands: Any, debug: argparse.ArgumentParser) -> None:
    evaluate = commands.add_parser(
        "eval", parents=[debug], help="greedy accuracy, pass@k and mean@k of a model folder on a built-in task"
    )
    evaluate.add_argument("--model", required=True, help="a local model folder (e.g. runs/sft/final)")
    evaluate.add_argument("--task", default="reverse", help="built-in task (reverse, arithmetic)")
    evaluate.add_argument(
        "--data", default=None, help="a data file (.jsonl, .csv, .parquet, ...) with a prompt column, instead of --task"
    )
    evaluate.add_argument("--reward", default=None, help="reward to score with (default: the task's)")
    evaluate.add_argument("--n", type=at_least(1), default=500, help="held-out rows (with --data: the first n)")
    evaluate.add_argument(
        "--k",
        type=at_least(1),
        default=1,
        help="also report pass@k and mean@k (with its standard error) over k samples at temperature 1",
    )
    evaluate.add_argument("--max-new-tokens", type=at_least(1), default=16)
    evaluate.add_argument(
        "--prompt-template", default=None, help="as data.prompt_template in the run's config (e.g. r1_zero)"
    )
    evaluate.add_argument(
        "--chat-template", action="store_true", help="as data.chat_template: prompts through the chat template"
    )
    evaluate.add_argument(
        "--stop", action="append", default=[], help="a string that ends completions, as sampling.stop (repeatable)"
    )
    evaluate.add_argument("--seed", type=int, default=0, help="seeds the held-out set and sampling")
    evaluate.add_argument("--output", default=None, help="write every completion, its reward and mark to this JSONL")
    evaluate.add_argument("--show-failed", type=at_least(0), default=5, help="failed examples printed")
    evaluate.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    evaluate.set_defaults(handler=_eval)


def _add_models(commands: Any, debug: argparse.ArgumentParser) -> None:
    models = commands.add_parser("models", parents=[debug], help="model files: import-gguf")
    model_commands = models.add_subparsers(
        title="model commands", dest="model_command", metavar="COMMAND", required=True
    )
    gguf = model_commands.add_parser(
        "import-gguf",
        parents=[debug],
        help="turn a .gguf file (llama.cpp) into a Hugging Face folder",
        description="Read a GGUF file with transformers (weights dequantised), rebuild a plain model of the "
        "same architecture and write it with its tokenizer and chat template as a Hugging Face folder that "
        "plain transformers loads. Needs the gguf package (pip install 'posttrain[gguf]').",
    )
    gguf.add_argument("file", help="the .gguf file")
    gguf.add_argument("out_dir", help="the folder to write")
    gguf.set_defaults(handler=_import_gguf)


def _add_demo(commands: Any, debug: argparse.ArgumentParser) -> None:
    demo = commands.add_parser(
        "demo",
        parents=[debug],
        help="SFT a tiny model to reverse names, then GRPO, on this machine (about 5 minutes on a laptop CPU)",
        description="Build a character tokenizer and a tiny Llama locally, SFT it on labelled names until it "
        "is right about half the time, then run GRPO on unlabelled prompts with a 0/1 exact-match reward; "
        "print its answers on nine hand-picked names and held-out exact match after each stage, and compare "
        "with SFT continued for the same time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # These defaults repeat DemoConfig's (reading them from it would import torch for --help);
    # tests/test_cli.py checks that the two agree. The RL flags default to None: they override
    # keys of the RL stage's config (posttrain/demo_rl.yaml) only when given.
    demo.add_argument("--seed", type=at_least(0), default=0, help="seeds weights, names, shuffling and sampling")
    demo.add_argument("--output-dir", default="runs/demo", help="run directory")
    demo.add_argument("--rl-steps", type=at_least(1), default=None, help="GRPO steps (steps=N; demo_rl.yaml: 600)")
    demo.add_argument("--sft-max-steps", type=at_least(1), default=400, help="SFT steps at most (it stops early)")
    demo.add_argument("--no-baseline", action="store_true", help="skip the continued-SFT comparison")
    demo.add_argument("--threads", type=at_least(1), default=None, help="torch threads; all cores if not given")
    demo.add_argument(
        "--max-staleness",
        type=at_least(0),
        default=None,
        help="asynchronous RL: sample up to this many policy versions ahead of the learner (0: synchronous)",
    )
    demo.add_argument(
        "--interrupt",
        action="store_true",
        help="with --max-staleness: generations in flight switch to the learner's new weights mid-way",
    )
    demo.add_argument(
        "--ray-workers",
        type=at_least(0),
        default=0,
        help="sample the RL stage on this many Ray rollout workers (a local Ray cluster; needs posttrain[dist])",
    )
    demo.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="overrides of the RL stage's config (posttrain/demo_rl.yaml), e.g. algorithm=dapo learning_rate=3e-4",
    )
    demo.set_defaults(handler=_demo)


def to_devnull(stream: Any) -> None:
    """Point ``stream``'s file at /dev/null once its reader has gone: the interpreter's own flush
    at exit then stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


class OutlivesItsReader:
    """stdout for a training command: when its reader goes away (``posttrain rl ... | head -1``)
    the rest of the output is dropped and training goes on to its checkpoints and ``final/``,
    instead of ending at the next print with a BrokenPipeError."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.reader_gone = stream, False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._drop_the_rest()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop_the_rest()

    def _drop_the_rest(self) -> None:
        self.reader_gone = True
        to_devnull(self.stream)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the stream itself
        return getattr(self.stream, name)


def _say_how_to_go_on(name: str, args: argparse.Namespace, argv: Sequence[str] | None, what: str) -> None:
    """After Ctrl-C or SIGTERM: what was kept, where a resumed run starts, and the command that
    resumes it (the one typed, with --resume auto). Printed by rank 0 alone under torchrun."""
    if os.environ.get("RANK", "0") != "0":
        return
    output_dir = getattr(args, "output_dir", None)
    if args.command not in TRAINING_COMMANDS or not output_dir:
        print(f"\n{name}: {what}", file=sys.stderr)
        return
    from posttrain.run.checkpoint import latest_checkpoint

    newest = latest_checkpoint(output_dir)
    if newest is None:
        kept = f"there is no checkpoint in {output_dir}, so a resumed run starts again from step 1"
    else:
        kept = f"the newest checkpoint is {newest.path}: a resumed run continues at step {newest.step + 1}"
    print(f"\n{name}: {what}; {kept}. Resume with:\n  {resume_command(argv)}", file=sys.stderr)


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE``."""
    words, kept = list(argv), []
    while words:
        word = words.pop(0)
        if word == option and words:
            words.pop(0)
        elif not word.startswith(f"{option}="):
            kept.append(word)
    return kept


def resume_command(argv: Sequence[str] | None) -> str:
    """The command line typed, any resume choice replaced by ``--resume auto``."""
    typed = os.environ.get("POSTTRAIN_COMMAND")  # set by --nproc-per-node for the ranks it starts
    words = shlex.split(typed)[1:] if typed else list(sys.argv[1:] if argv is None else argv)
    kept = [word for word in without_option(words, "--resume") if not word.startswith("resume=")]
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    torchrun = processes > 1 and not typed
    launcher = ["torchrun", f"--nproc_per_node={processes}", "-m", "posttrain"] if torchrun else ["posttrain"]
    return shlex.join([*launcher, *kept, "--resume", "auto"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status. An error the user can act on (a
    :class:`~posttrain.errors.PosttrainError`) is one message on stderr and status 2; Ctrl-C is
    status 130 with how to continue; ``--debug`` lets either raise with its traceback."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow a flag (`... --resume auto steps=10`); argparse takes the
    # positionals of one stretch only, so the later ones are appended here, in their order
    if extra and hasattr(args, "overrides") and all(OVERRIDE.match(item) for item in extra):
        args.overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    from posttrain.errors import PosttrainError
    from posttrain.run.stopping import Stopped

    name = " ".join(filter(None, ["posttrain", args.command, getattr(args, "model_command", None)]))
    stdout = sys.stdout
    if args.command in TRAINING_COMMANDS and not isinstance(stdout, OutlivesItsReader):
        sys.stdout = OutlivesItsReader(stdout)
    try:
        if args.command not in TRAINING_COMMANDS:  # only the training commands run data parallel
            from posttrain.distributed import single_process_only

            single_process_only(args.command)
        return args.handler(args)
    except PosttrainError as error:
        if args.debug:
            raise
        print(f"{name}: {error}", file=sys.stderr)
        if "posttrain.distributed" in sys.modules:  # under torchrun: the root cause of its failure summary
            sys.modules["posttrain.distributed"].tell_torchrun(f"{name}: {error}")
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        _say_how_to_go_on(name, args, argv, "interrupted (Ctrl-C)")
        return 130
    except Stopped as error:  # SIGTERM, handled at a step's end (run/stopping.py)
        if args.debug:
            raise
        _say_how_to_go_on(name, args, argv, str(error))
        return 143
    except BrokenPipeError:
        # the reader went away (`posttrain rl --options | head -1`): nothing more can be printed
        to_devnull(sys.stdout)
        return 1
    finally:
        sys.stdout = stdout
        if "posttrain.distributed" in sys.modules:  # a command that ran under torchrun leaves its group
            sys.modules["posttrain.distributed"].leave()
