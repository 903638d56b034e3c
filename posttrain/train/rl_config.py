"""The config of ``posttrain rl``: every option documented once, algorithm presets, and the
checks that reject an impossible combination before any model loads.

An *algorithm* is data, not a class (docs/design.md, "One idea"): a choice of advantage
estimator, policy loss, aggregation, KL placement and a few data-side switches. The named
presets are YAML files in ``posttrain/presets/`` (shipped inside the package, so
``algorithm: grpo`` works after a plain ``pip install``); ``algorithm: grpo`` loads one and
``algorithm.kl.coef=0.01`` then changes a single field of it.

Batch semantics, spelled out once:

* ``prompts_per_step`` prompts are drawn per step, ``samples_per_prompt`` completions are
  sampled for each (a *group*): the rollout batch holds ``prompts_per_step × samples_per_prompt``
  samples, all drawn from the current weights.
* ``ppo_epochs`` passes are made over that batch, each split into minibatches of
  ``minibatch_size`` samples (whole groups stay together); every minibatch is one optimizer
  step. With one epoch and one minibatch (the defaults) the step is purely **on-policy**: the
  ratio π/π_old is 1 and clipping never triggers. Any further optimizer step inside the same
  rollout batch is **off-policy** with respect to the weights that sampled it, which is what the
  clipped ratio corrects for.
* ``micro_batch_size`` only bounds memory: a minibatch is processed in micro-batches whose
  gradients accumulate; the loss is normalised over the whole minibatch, so results do not
  depend on it (up to float rounding).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.algos import POLICY_LOSSES
from posttrain.config import (
    ConfigError,
    deep_merge,
    load_yaml,
    parse_overrides,
    read_yaml,
    validate_config,
    with_default,
)
from posttrain.envs.section import EnvSection
from posttrain.models.section import LoraSection, ModelSection
from posttrain.rollout.ray_engine import ClusterSection
from posttrain.run.run_options import OptimizerOptions, RunOptions
from posttrain.train.rl_combinations import combination_problems, unknown_choice
from posttrain.train.rl_sections import AlgorithmSection, RLDataSection, RolloutSection, SamplingSection

PRESET_PACKAGE = "posttrain.presets"


class RLRun(RunOptions, OptimizerOptions):
    """Everything ``posttrain rl`` reads: the options every training command has
    (run/run_options.py; RL's defaults for steps, rate, warm-up and folder) and RL's own."""

    steps: int = with_default(RunOptions, "steps", 200)
    learning_rate: float = with_default(OptimizerOptions, "learning_rate", 1e-5)
    warmup_steps: int = with_default(OptimizerOptions, "warmup_steps", 0)
    output_dir: str = with_default(RunOptions, "output_dir", "runs/rl")

    model: ModelSection
    """The policy to train (a local folder, or a tiny model built here)."""
    data: RLDataSection
    """Prompts (any other column reaches the reward functions)."""
    rewards: list[str | dict[str, Any]] = Field(default_factory=list)
    """Reward functions: built-in names, "pkg.module:fn" paths or {name: ..., options...};
    empty: the built-in task's own reward. With env they score the finished conversation (its
    messages), added to the environment's own rewards; with env they may be left out."""
    env: EnvSection | None = None
    """A multi-turn environment (built-in or pkg.module:Class): each sample is an episode of
    policy turns and environment answers, started from a row (its columns go to reset); null:
    one completion per prompt."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default 1 each)."""
    reward_workers: int | None = Field(None, ge=0)
    """Worker processes for plain reward functions (default: one per core, at most 8); 0 runs
    them in threads, which costs no start-up (~2 s and ~300 MB per worker) for cheap rules."""
    reward_timeout: float | None = Field(600.0, gt=0)
    """Seconds one reward call may take; past it its samples get None (counted in
    reward/<name>/timeouts) and the run goes on. null: wait forever."""
    reward_max_failed_fraction: float = Field(0.5, ge=0, le=1)
    """Stop the run when one reward function leaves more than this share of a batch's samples
    without a score (timeouts, crashes, None/NaN where it scores other samples of the same
    prompt); a rewards entry's own max_failed_fraction overrides it. 1: never stop."""
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    """The algorithm: `algorithm: grpo` loads a preset; sub-keys override its fields."""
    prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per step."""
    samples_per_prompt: int = Field(8, ge=1)
    """Completions sampled per prompt (the group size G)."""
    minibatch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (a multiple of samples_per_prompt); null: the whole batch."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward pass (memory only); null: the whole minibatch. It bounds
    every training pass: π_old and reference log-probs, the critic's values and the updates.
    Generation is the engine's: sampling runs the whole rollout batch, and ReMax's greedy
    baseline, one completion per prompt, is a smaller batch than that."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per forward/backward pass (samples × the micro-batch's longest, padding included),
    as a bound beside micro_batch_size. With neither set, ``posttrain rl`` derives it from the
    memory plan and the device's memory (``--plan`` shows it), writes it into the run's
    config.yaml and checkpoints, and a resumed run takes the recorded value."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    max_new_tokens: int = Field(16, ge=1)
    """Generation limit; a completion that reaches it is "truncated"."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling options."""
    temperature: float | None = Field(None, gt=0)
    """Shortcut for sampling.temperature (docs/design.md's top-level key)."""
    shared_prompt_forward: bool = True
    """Training forward passes encode each prompt once per group instead of once per sample
    (same values up to float rounding, about a third of the work with 8 samples per prompt);
    needs a model that takes a transformers DynamicCache (any standard causal LM). A model with
    ``model.gradient_checkpointing`` trains with the full forward (a checkpointed forward keeps no cache)."""
    padding_free: bool = False
    """Training forward passes lay each micro-batch's samples end to end in one row, each
    attending only to itself (models/packing.py): no padding is computed and no attention mask
    is built; ``micro_batch_tokens`` then bounds the real tokens of a pass. Each sample's prompt
    is computed with it (``shared_prompt_forward`` applies to padded passes)."""
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """The rollout engine and the engine/trainer log-prob reconciliation."""
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where the rollouts are generated: here (local) or by Ray actors (rollout/ray_engine.py)."""
    engine: Literal["auto", "native", "transformers", "vllm"] | None = None
    """Shortcut for rollout.engine."""
    preflight: bool = True
    """Before the first update, run the rewards on one sampled batch and stop if a function
    raises, returns None/NaN for every sample, or gives every sample the same value."""
    allow_constant_reward: list[str] = Field(default_factory=list)
    """Reward names the pre-flight check may find constant (e.g. a format reward no sample
    meets yet)."""
    eval_size: int = Field(500, ge=0)
    """Held-out prompts evaluated (0: no evaluation)."""
    eval_k: int = Field(0, ge=0)
    """Besides the greedy pass, this many completions (episodes, for an environment) per held-out
    prompt sampled at the run's temperature: ``eval/pass_at_k`` (a single-turn run: at least one
    of them scores 1) and ``eval/mean_at_k`` (their mean score), ``eval/sampled_<figure>`` for an
    environment (its resolution rate, turns per resolution and return over every sampled
    episode). 0: greedy only."""
    eval_batch_size: int = Field(256, ge=1)
    """Held-out sequences generated at once: prompts in the greedy pass, ``eval_batch_size // eval_k``
    prompts' samples in the sampled one (lower it to bound the KV cache of a large model)."""
    log_samples: int = Field(4, ge=0)
    """Completions written to samples.jsonl per step."""
    monitor_window: int = Field(20, ge=0)
    """The reward-hacking alarm (rewards/hacking_alarm.py): with a monitor — a reward of weight 0 in
    reward_weights, measured but not optimised — warn once when, from the half-window before the
    newest (monitor_window / 2 steps) or from the run's first, the optimised reward rose while the
    monitor fell (each by ≥ 3 standard errors) and the next two half-windows confirm the fall,
    with the evidence in alarm.json, the report and posttrain view. 0: off."""
    record_rollouts: bool | Literal["auto"] = "auto"
    """Write the steps' scored batches under output_dir/rollouts/ (tensors in safetensors, text in
    JSON, with a schema version) for ``posttrain view`` and rollout.replay. true: every step (a
    replayable recording); auto: every step of a run of at most 200 steps, every ⌈steps/200⌉-th
    step of a longer one (at most 200 steps recorded, for viewing; not replayable); false: none."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads (default: every core this process may use)."""

    @field_validator("monitor_window")
    @classmethod
    def _a_window_that_can_fire(cls, window: int) -> int:
        # the alarm compares half-windows by their standard errors: a half of one step has none
        if 0 < window < 4:
            raise ValueError(f"monitor_window {window} can never fire (its halves need 2 steps each): 0 or 4 and up")
        return window

    @model_validator(mode="after")
    def _episode_rows(self) -> RLRun:
        # with env a row is where an episode starts: any columns, no prompt needed
        if self.env is not None and self.data.format is None:
            self.data.format = "episode"
        return self

    @model_validator(mode="after")
    def _check_combination(self) -> RLRun:
        problems = combination_problems(self)
        if problems:
            raise ValueError("\n  - ".join(problems))
        return self

    @property
    def rollout_batch_size(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def temperature_value(self) -> float:
        return self.temperature if self.temperature is not None else self.sampling.temperature

    @property
    def engine_kind(self) -> str:
        return self.engine if self.engine is not None else self.rollout.engine

    @property
    def critic_adapters(self) -> LoraSection | None:
        """The adapters the critic trains through (``algorithm.critic.lora``), or None: trained in full."""
        critic = self.algorithm.critic
        wanted = critic is not None and (critic.lora if critic.lora is not None else self.model.lora is not None)
        return (self.model.lora or LoraSection()) if wanted else None

    # What a step does, derived from the options: the loop's stages and the memory plan read these,
    # so the planner needs the config only, never a stage.
    @property
    def minibatch_samples(self) -> int:
        """Samples per optimizer step: ``minibatch_size``, or the whole rollout batch."""
        return self.minibatch_size or self.rollout_batch_size

    @property
    def several_updates(self) -> bool:
        """Whether a batch gets more than one optimizer step (then π_old and π differ after the first)."""
        return self.ppo_epochs > 1 or self.minibatch_samples < self.rollout_batch_size

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Only with more than one optimizer step per batch do π_old and π differ; on-policy
        the ratio is exactly 1 and π_old is π detached (TRL does the same). The decoupled loss with
        ``algorithm.proximal: loglinear`` approximates its π_prox instead of this forward pass."""
        return self.several_updates and self.algorithm.proximal == "recompute"

    @property
    def anchors_on_engine(self) -> bool:
        """Whether π_old is the engine's log-probs rather than the trainer's.

        Asynchronous runs (``rollout.max_staleness`` ≥ 1) sample with weights up to η updates older
        than the policy at the start of the step: a policy loss anchored on the trainer's log-probs
        would clip around a policy that never generated the data, and its ratio would not correct
        for the staleness (a reported pitfall of async RL stacks). So a loss without a proximal
        policy takes π_old = π_behav, the engine's log-probs (PPO's ratio against the sampling
        policy); the decoupled loss gets both (train/rl_update.py)."""
        return self.rollout.max_staleness >= 1 and not POLICY_LOSSES.declares(
            self.algorithm.policy_loss, "proximal_logprobs"
        )


def preset_names() -> list[str]:
    """Names of the algorithm presets shipped with posttrain."""
    folder = resources.files(PRESET_PACKAGE)
    return sorted(Path(item.name).stem for item in folder.iterdir() if item.name.endswith(".yaml"))


def _preset_file(name: str) -> dict[str, Any]:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return read_yaml(path)
    file = resources.files(PRESET_PACKAGE) / f"{name}.yaml"
    if not file.is_file():
        raise ConfigError(unknown_choice("algorithm", name, preset_names()))
    return load_yaml(file.read_text(encoding="utf-8")) or {}


def read_preset(name: str) -> dict[str, Any]:
    """The ``algorithm`` section a preset name stands for (a path to a YAML file also works)."""
    data = _preset_file(name)
    section = data.get("algorithm", data)
    if not isinstance(section, dict):
        raise ConfigError(f"preset {name!r} must hold a mapping under 'algorithm'")
    return {**section, "preset": name}


def preset_rollout(name: str) -> dict[str, Any]:
    """The ``rollout`` defaults a preset brings besides its algorithm (``one_step_off_policy``:
    max_staleness 1); the config's own rollout keys override them."""
    data = _preset_file(name)
    section = data.get("rollout", {}) if "algorithm" in data else {}
    if not isinstance(section, dict):
        raise ConfigError(f"preset {name!r}: 'rollout' must be a mapping")
    return section


def _normalise_algorithm(raw: dict[str, Any]) -> dict[str, Any]:
    value = raw.get("algorithm")
    if isinstance(value, str):
        return {**raw, "algorithm": {"preset": value}}
    return raw


def rl_config_layers(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> list[tuple[str, dict[str, Any]]]:
    """What an RL config is made of, lowest first, each layer named by where it comes from: the
    algorithm preset's keys (``preset NAME``), the YAML file's, the command line's. Merged in
    order, each over the ones before, they are the config the defaults then complete.

    ``algorithm: grpo`` (file or override) selects a preset; the file's and the overrides'
    other ``algorithm.*`` keys are applied on top of it, whichever order they come in.
    """
    raw = _normalise_algorithm(read_yaml(path) if path is not None else {})
    # `algorithm=NAME` names the preset; spelled as a sub-key it combines with algorithm.* overrides
    overrides = [
        f"algorithm.preset={item.partition('=')[2]}" if item.strip().startswith("algorithm=") else item
        for item in overrides
    ]
    update = parse_overrides(overrides)
    if "preset" in update.get("algorithm", {}):
        # a new preset on the command line replaces the file's algorithm section entirely
        raw = {key: value for key, value in raw.items() if key != "algorithm"}
    layers: list[tuple[str, dict[str, Any]]] = []
    algorithm = deep_merge(raw, update).get("algorithm")
    if isinstance(algorithm, dict) and algorithm.get("preset"):
        name = algorithm["preset"]
        rollout = preset_rollout(name)
        layers.append((f"preset {name}", {"algorithm": read_preset(name), **({"rollout": rollout} if rollout else {})}))
    if path is not None:
        layers.append((str(path), raw))
    layers.append(("command line", update))
    return layers


def load_rl_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RLRun:
    """defaults ← preset ← YAML file ← dotted overrides, validated as one (:func:`rl_config_layers`)."""
    merged: dict[str, Any] = {}
    for _, layer in rl_config_layers(path, overrides):
        merged = deep_merge(merged, layer)
    return validate_config(RLRun, merged, source=str(path) if path else "the command line")


def header_notes(command: str, path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """What the run header notes of how ``posttrain COMMAND`` resolved its config: for ``rl``, a
    preset named on the command line replacing the file's algorithm section."""
    note = replaced_algorithm_section(path, overrides) if command == "rl" else None
    return [note] if note else []


def replaced_algorithm_section(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The header's note when a preset named on the command line replaces the config file's whole
    ``algorithm:`` section (its KL settings and loss options go with it, :func:`rl_config_layers`),
    or None when nothing is replaced."""
    preset = next((item.partition("=")[2] for item in overrides if item.strip().startswith("algorithm=")), None)
    preset = preset or next(
        (item.partition("=")[2] for item in overrides if item.strip().startswith("algorithm.preset=")), None
    )
    if path is None or not preset:
        return None
    section = read_yaml(path).get("algorithm")
    if not section:
        return None
    return f"algorithm: preset {preset} replaces {path}'s algorithm section (algorithm.* overrides keep parts of it)"
