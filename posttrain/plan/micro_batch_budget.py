"""The default micro-batch: a token budget from the memory plan and the device's memory.

With neither ``micro_batch_size`` nor ``micro_batch_tokens`` set (nor, for SFT, RM and DPO,
``gradient_accumulation`` above 1), a command sizes its passes itself: the largest multiple of
``QUANTUM`` tokens, from the whole minibatch down, whose planned peak stays within
``HEADROOM`` of the memory one process may count on (``memory_gib``, a GPU's, or this machine's
shared by its processes; plan.py), less a fixed ``CPU_RESERVE`` on the CPU. Only quantities
every rank has alike enter it (the config, the shapes, the data, the device's total memory), so
every rank derives the same budget, and the run checks that they do (``World.same_everywhere``).

The budget is written into the resolved config, so it is in the run's config.yaml and in every
checkpoint's; a resumed run takes the value its checkpoint recorded and never derives it again,
even where memory differs, so it cuts its passes as the straight run did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import ConfigError
from posttrain.plan.memory_model import MemoryPlan
from posttrain.plan.plan import PlanInputs, make_plan, micro_rows

QUANTUM = 256  # tokens: budgets are multiples of it (the smallest one too: a plan needing less is refused)
HEADROOM = 0.8  # of the device's memory: allocator fragmentation and what the plan does not count
CPU_RESERVE = 2**30  # the interpreter, libraries and the system, on the CPU
# On the CPU a larger pass runs no faster once its tensors are far beyond the caches, and costs
# memory: SmolLM2-135M's LoRA GRPO update took 0.62× the time with 8 samples a pass against 0.44×
# with 4, and 1.07× that with 2 (benchmarks/rl_step_profile.py; the plan: 1.4 GiB for 4 samples).
# So a pass is also kept within this many planned bytes.
CPU_PASS_BYTES = 3 * 2**29
TRAINING_PHASES = ("update", "critic update", "training step", "log-probs", "values")


def needs_budget(command: str, config: Any) -> bool:
    """Whether the command sizes its passes itself: no bound set by the user."""
    if getattr(config, "micro_batch_tokens", None) is not None:
        return False
    if command == "rl":
        return config.micro_batch_size is None
    return config.gradient_accumulation == 1


def whole_tokens(inputs: PlanInputs, config: Any) -> int:
    """Tokens of one pass over the whole minibatch (the most any budget can use)."""
    if inputs.command == "rl":
        return config.minibatch_samples * (inputs.length + config.max_new_tokens)
    pair = 2 if inputs.command in ("rm", "dpo") else 1
    return config.batch_size * pair * inputs.length


def derive_budget(inputs: PlanInputs, config: Any, available: int, cpu: bool) -> int:
    """The largest multiple of ``QUANTUM`` tokens, at most the whole minibatch's (rounded up),
    whose planned peak (the process itself left out: not the same on every rank) fits the
    device — and on the CPU whose training passes stay within ``CPU_PASS_BYTES``. The plan grows
    with the budget, so the largest is found by bisection."""
    target = available * HEADROOM - (CPU_RESERVE if cpu else 0)
    low, high = 1, max(1, -(-whole_tokens(inputs, config) // QUANTUM))  # in quanta; low always taken
    while low < high:
        middle = (low + high + 1) // 2
        if _fits(make_plan(inputs, _sized(config, middle * QUANTUM)), target, cpu):
            low = middle
        else:
            high = middle - 1
    return low * QUANTUM


def _sized(config: Any, budget: int) -> Any:
    return config.model_copy(update={"micro_batch_tokens": budget})


def _fits(plan: MemoryPlan, target: float, cpu: bool) -> bool:
    if plan.peak - plan.runtime > target:
        return False
    training = [phase.total for phase in plan.phases if phase.name in TRAINING_PHASES]
    return not cpu or max(training, default=0) <= CPU_PASS_BYTES


def recorded_budget(config: Any) -> tuple[bool, int | None]:
    """(whether the run resumes from a checkpoint, the ``micro_batch_tokens`` its config.yaml
    recorded: None where it had none, e.g. a checkpoint written before this option)."""
    from posttrain.config import load_yaml
    from posttrain.run.run_dir import start_point

    if config.resume == "none":
        return False, None
    checkpoint = start_point(config.output_dir, config.resume, config.overwrite, None).checkpoint
    if checkpoint is None:
        return False, None
    saved = Path(checkpoint) / "config.yaml"
    values = load_yaml(saved.read_text(encoding="utf-8")) if saved.is_file() else None
    value = values.get("micro_batch_tokens") if isinstance(values, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(  # a checkpoint is anyone's file: its value is checked as a config's would be
            f"{saved}: micro_batch_tokens is {value!r}, not a positive whole number of tokens; set "
            "micro_batch_tokens in the config to resume with your own value"
        )
    return True, value


def resolve_budget(inputs: PlanInputs, config: Any, available: int | None, cpu: bool) -> tuple[Any, str | None]:
    """``config`` with ``micro_batch_tokens`` filled in where the command sizes its passes, and
    where the value comes from ("derived", "recorded"), or None when the user set the bounds."""
    if not needs_budget(inputs.command, config):
        return config, None
    resumes, recorded = recorded_budget(config)
    if resumes:
        return config.model_copy(update={"micro_batch_tokens": recorded}), "recorded"
    if available is None:
        return config, None
    return config.model_copy(update={"micro_batch_tokens": derive_budget(inputs, config, available, cpu)}), "derived"


def budget_line(inputs: PlanInputs, config: Any, origin: str | None) -> str | None:
    """How the passes are sized, for the plan's printout."""
    tokens = config.micro_batch_tokens
    if origin is None or tokens is None:
        return None
    where = "recorded in the checkpoint" if origin == "recorded" else "derived from the device's memory"
    if inputs.command == "rl":
        rows = micro_rows(config, config.minibatch_samples, inputs.length + config.max_new_tokens)
        where += f"; about {rows} samples of the longest"
    return f"  {'micro-batch':<13} {tokens} tokens ({where}): micro_batch_tokens"
