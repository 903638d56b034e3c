"""The memory plan (``posttrain ... --plan``) against the peak a run really reaches.

Each case runs in its own process: the plan is made from the resolved config (no weights), then
the run trains a few steps while a thread samples the resident memory (``VmRSS``) every 5 ms
and notes the stage running (generation, log-probs, update, evaluation, training step). One JSON
line per case: the planned and measured peak, their ratio, and each stage's planned addition
against its measured peak above what was resident before the first stage.

    .venv/bin/python benchmarks/memory_plan.py                 # every case
    .venv/bin/python benchmarks/memory_plan.py --case demo_rl  # one

The SmolLM2 cases need runs/smollm2/base (docs/real-models.md); they are left out without it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "runs/smollm2/base"
TINY = "model.tiny={arch: llama, layers: 2, hidden: 128, heads: 4}"
# a random model's samples all score 0 on the reversal task, so no sample would be trained; this
# reward tells them apart (the update then runs on every sample, as in a real run)
REVERSE = "rewards=[benchmarks.memory_plan:distinct_characters]"


def distinct_characters(completions: list[str], **_: object) -> list[float]:
    """How many different characters a completion has (a reward that varies for any model)."""
    return [float(len(set(text))) for text in completions]


CASES: dict[str, tuple[str, str | None, list[str]]] = {
    # name: (command, config, overrides); every case trains 3 steps into a temporary folder
    "demo_sft": ("sft", "configs/reverse_sft.yaml", ["eval_every=2"]),
    "demo_rl": ("rl", "posttrain/demo_rl.yaml", [TINY, REVERSE, "eval_every=2", "eval_size=500", "data.n_eval=500"]),
    "tiny_ppo_critic": ("rl", "posttrain/demo_rl.yaml", [TINY, REVERSE, "algorithm.preset=ppo", "eval_every=0"]),
    "tiny_dpo": ("dpo", "configs/rlhf_dpo.yaml", [TINY, "model.path=null", "eval_every=0", "batch_size=64"]),
    "tiny_wide_kl": (
        "rl",
        "posttrain/demo_rl.yaml",
        [
            "model.tiny={arch: qwen2, layers: 4, hidden: 512, heads: 8}",
            "algorithm.kl={placement: loss, coef: 0.04}",
            "max_new_tokens=64",
            "sampling.stop=[]",
            "eval_every=0",
            REVERSE,
        ],
    ),
    "smollm2_lora_grpo": (
        "rl",
        "configs/smollm2_arithmetic.yaml",
        [
            f"model.path={SMOLLM2}",
            "eval_every=0",
            "eval_size=0",
            "algorithm.dynamic_sampling.enabled=false",
            "data.curriculum=null",
        ],
    ),
    "smollm2_full_checkpointed": (
        "rl",
        "configs/smollm2_arithmetic.yaml",
        [
            f"model.path={SMOLLM2}",
            "model.lora=null",
            "model.gradient_checkpointing=true",
            "micro_batch_size=8",
            "eval_every=0",
            "eval_size=0",
            "algorithm.dynamic_sampling.enabled=false",
            "data.curriculum=null",
            "max_new_tokens=64",
        ],
    ),
    "smollm2_lora_sft": (
        "sft",
        "configs/smollm2_arithmetic_sft.yaml",
        [
            f"model.path={SMOLLM2}",
            "data.path=null",
            "data.task=reverse",
            "data.n_train=64",
            "data.n_eval=9",
            "eval_size=0",
        ],
    ),
}


class Sampler(threading.Thread):
    """VmRSS every 5 ms, with the stage running, into per-stage peaks."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        from posttrain.run.out_of_memory import current_stage

        self.current_stage, self.peaks, self.before, self.running = current_stage, {}, None, True

    def run(self) -> None:
        from posttrain.memory import resident_bytes

        while self.running:
            rss = resident_bytes()
            name = self.current_stage()
            if name is None and self.before is None:
                self.baseline = rss
            elif name is not None:
                if self.before is None:
                    self.before = self.baseline
                self.peaks[name] = max(self.peaks.get(name, 0), rss)
            time.sleep(0.005)


def run_case(name: str) -> dict:
    """In this process: plan, then train 3 steps, sampling memory."""
    import resource

    from posttrain.config import load_config
    from posttrain.plan.announce import announce_plan
    from posttrain.plan.plan import plan_for
    from posttrain.train import recipes

    command, path, overrides = CASES[name]
    out = tempfile.mkdtemp(prefix=f"memplan-{name}-")
    overrides = [*overrides, "steps=3", f"output_dir={out}", "save_every=0", "report_to=[]"]
    if command == "rl":
        from posttrain.train.rl import run_rl
        from posttrain.train.rl_config import load_rl_config

        config, runner = load_rl_config(path, overrides), run_rl
    else:
        classes = {"sft": (recipes.SFTRun, recipes.run_sft), "dpo": (recipes.DPORun, recipes.run_dpo)}
        cls, runner = classes[command]
        config = load_config(cls, path, overrides)
    config = announce_plan(command, config, echo=False)  # the micro-batch budget, as the command sizes it
    plan, _, _ = plan_for(command, config)
    sampler = Sampler()
    sampler.start()
    runner(config)
    sampler.running = False
    sampler.join()
    measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resident = plan.runtime + plan.resident.total
    stages = {
        phase.name: {
            "planned_mib": round((resident + phase.total) / 2**20),
            "measured_mib": round(sampler.peaks.get(phase.name, 0) / 2**20),
        }
        for phase in plan.phases
    }
    return {
        "case": name,
        "planned_peak_mib": round(plan.peak / 2**20),
        "measured_peak_mib": round(measured / 2**20),
        "ratio": round(plan.peak / measured, 3),
        "runtime_mib": round(plan.runtime / 2**20),
        "resident_mib": round(plan.resident.total / 2**20),
        "micro_batch_tokens": getattr(config, "micro_batch_tokens", None),
        "before_first_stage_mib": round((sampler.before or 0) / 2**20),
        "stages": stages,
        "plan": {phase.name: {k: round(v / 2**20) for k, v in phase.parts.items()} for phase in plan.phases},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="run these cases (default: all)")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        print("RESULT " + json.dumps(run_case(args.case[0])), flush=True)
        return
    names = args.case or [n for n in CASES if SMOLLM2.is_dir() or "smollm2" not in n]
    for name in names:
        done = subprocess.run(
            [sys.executable, __file__, "--in-process", "--case", name],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(json.dumps({"case": name, "error": done.stderr[-2000:]}), flush=True)
            continue
        print(lines[-1].removeprefix("RESULT "), flush=True)


if __name__ == "__main__":
    main()
