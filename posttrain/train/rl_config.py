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

from pydantic import Field, model_validator

from posttrain.config import (
    ConfigError,
    Section,
    deep_merge,
    load_yaml,
    parse_overrides,
    read_yaml,
    validate_config,
    with_default,
)
from posttrain.data.curriculum import CurriculumSection
from posttrain.data.section import DataSection
from posttrain.envs.section import EnvSection
from posttrain.models.section import LoraSection, ModelSection
from posttrain.rollout.ray_engine import ClusterSection
from posttrain.rollout.vllm_engine import VLLMOptions
from posttrain.run.run_options import OptimizerOptions, RunOptions
from posttrain.sources.difficulty_filter import DataFilterSection
from posttrain.sources.dynamic_sampling import DynamicSamplingSection
from posttrain.sources.overlong import OverlongSection
from posttrain.train.rl_combinations import combination_problems, unknown_choice

PRESET_PACKAGE = "posttrain.presets"


class KLSection(Section):
    """Where the KL to the reference policy goes, and how strong it is (docs/algorithms.md §3)."""

    placement: Literal["none", "reward", "loss"] = "none"
    """"reward": r_t ← r_t − β·kl_t from the rollout policy (PPO-RLHF, RLOO, REINFORCE++);
    "loss": + β·agg(kl) differentiated through the current policy (GRPO); "none": no reference."""
    estimator: Literal["k1", "k2", "k3", "abs", "k1+", "k3+"] = "k1"
    """KL estimator (k1 unbiased; k3 unbiased and ≥ 0; k2 the right gradient in the loss)."""
    coef: float = Field(0.0, ge=0)
    """β, the initial coefficient."""
    controller: Literal["fixed", "adaptive", "adaptive_ppo"] = "fixed"
    """"adaptive": Ziegler et al.'s proportional rule toward `target`; "adaptive_ppo": the PPO
    paper's halve/double rule; both only with placement "reward"."""
    target: float = Field(0.1, gt=0)
    """KL target of the adaptive controllers (nats per token, mean over sequences), compared
    each step with the metric ``kl/reward``: the KL subtracted from the reward, measured with
    `estimator` on the rollout policy (``kl/ref`` is k3 of the policy being trained)."""
    horizon: int = Field(10000, ge=1)
    """Horizon of the proportional controller, in samples."""
    level: Literal["token", "sequence"] = "token"
    """With placement "reward": per-token penalties, or TRL-RLOO's one Σ_t kl on the last token."""
    monitor: bool = False
    """Measure the KL to the initial policy (metric kl/ref) even when it is not optimised
    (placement "none"), e.g. to watch a β = 0 run drift; costs one reference forward per step."""

    @property
    def needs_reference(self) -> bool:
        """Whether the run keeps a reference policy and computes its log-probs each step."""
        return self.placement != "none" or self.monitor


class CriticSection(Section):
    """The value model of PPO: the policy's body plus a scalar head, trained beside it."""

    learning_rate: float = Field(1e-3, gt=0)
    """AdamW rate of the critic."""
    init_from: str | None = None
    """A folder to start the critic from instead of the policy's body with a zero head: a
    reward model (``posttrain rm``'s final/: its body and its scalar head, so the values start
    as its scores), or a saved critic. It must read the policy's token ids (the same vocabulary)."""
    lora: bool | None = None
    """Train the critic through LoRA adapters (and its head) over a frozen base: the policy's own
    base, shared, when the policy has adapters (model.lora) and no init_from is set; otherwise a
    frozen copy of the body (the policy's or init_from's) with adapters of model.lora's shape (or
    the LoRA defaults). false: a full critic, trained in full. null: true exactly when model.lora
    is set."""
    value_clip: float | None = Field(0.5, gt=0)
    """Clip range of the value loss around the rollout-time values; null: unclipped."""
    loss_coef: float = 1.0
    """Kept only to refuse a value other than 1: the critic has its own AdamW, which is
    invariant to a constant scale of its loss (and gradient clipping scales it back too), so a
    weight here changed nothing. Use ``learning_rate`` to train the critic faster or slower."""


class AlgorithmSection(Section):
    """One RL algorithm = estimator × loss × aggregation × KL placement (docs/algorithms.md §9)."""

    preset: str | None = None
    """The preset this section started from (set by `algorithm: NAME`)."""
    advantage: str = "grpo"
    """Advantage estimator (posttrain.algos.ADVANTAGE_ESTIMATORS): gae, grpo, dr_grpo, rloo,
    remax, reinforce, reinforce_pp, reinforce_pp_baseline, gpg, gdpo."""
    advantage_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the estimator (e.g. {eps: 1e-6} for grpo, {gamma: 1, lam: 0.95} for gae)."""
    policy_loss: str = "ppo_clip"
    """Policy loss (posttrain.algos.POLICY_LOSSES): ppo_clip, gspo, gspo_token, cispo, sapo, pg."""
    loss_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the loss (e.g. {clip_low: 0.2, clip_high: 0.28})."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """The decoupled loss's π_prox (the policy at the start of the step): "recompute", a forward
    pass of it before the step's updates (when there is more than one; else the update's own
    forward); "loglinear", AReaL's approximation from the engine's log-probs and the current
    ones by each sample's version, ℓ_b + α(ℓ_θ − ℓ_b), α = (v_prox − v_b)/(v_prox + 1 − v_b),
    which saves that forward pass (algos.loglinear_proximal_logprobs)."""
    agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (docs/algorithms.md §1.2); seq-mean-token-sum-norm
    divides by max_new_tokens."""
    kl: KLSection = Field(default_factory=KLSection)
    """KL regularisation to the initial policy."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus c_ent (loss −= c_ent·agg(H))."""
    critic: CriticSection | None = None
    """A value model (needed by gae)."""
    baseline: str = "none"
    """Per-sample baseline handed to the estimator (posttrain.algos.BASELINES): "greedy" scores one
    greedy sample per prompt, a completion or an episode (ReMax), "running_mean" is a moving
    average of past rewards (classic REINFORCE), "none"."""
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)
    """DAPO dynamic sampling."""
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    """DAPO overlong reward shaping."""
    mask_truncated: bool = False
    """Leave completions cut by max_new_tokens out of the loss (TRL mask_truncated_completions)."""


class SamplingSection(Section):
    """How completions are sampled during training (evaluation is greedy)."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature; the trainer recomputes log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1 = off). Truncation makes the sampler differ from the trained policy:
    the engine logs the log-prob of the distribution it sampled from (renormalised over the kept
    tokens); rollout.keep_sampling_mask makes the trainer's log-probs match it."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion (kept in it), besides EOS: e.g. ["."] when the reward
    reads the answer up to the first ".", or ["</answer>"]. Text after the part the reward
    reads gets the sequence's advantage without affecting the reward; when most samples are
    right, rare variations there are reinforced more often than punished and drift (e.g. EOS
    giving way to runs of dots), so stopping where the answer ends keeps RL on what is graded."""


class RolloutSection(Section):
    """Which engine samples the completions, and how its log-probs are reconciled with the trainer's."""

    engine: Literal["auto", "native", "transformers", "vllm"] = "auto"
    """native: posttrain's KV-cache decoder for Llama/Qwen2 (the fastest on a CPU for small
    models); transformers: any causal LM; auto: native when it can; vllm: vLLM in this process,
    fed the new weights after every step (needs vLLM: pip install 'posttrain[vllm]', or the CPU
    recipe scripts/install_vllm_cpu.sh)."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    """How vLLM is started (engine vllm only): dtype, memory, eager mode, max length, seed."""
    cuda_graphs: bool = True
    """On a CUDA device, the native engine replays each decoding step as one CUDA graph (fixed
    shapes per batch bucket; rollout/static_decode.py): no per-step launch overhead. false:
    step by step, as on the CPU."""
    compile_step: bool = False
    """The native engine decodes over fixed shapes with each layer compiled by torch.compile
    into fused kernels (rollout/static_decode.py): meant for a GPU, where the compiled layers are
    what each CUDA graph replays (fewer kernels a step). Costs a one-time compile per process
    (20–30 s on 2 CPU cores, for any batch size). On a CPU it measured slower than eager
    decoding (docs/scaling.md)."""
    keep_sampling_mask: bool = False
    """With top_p < 1 or top_k > 0: the engine records each sampled token's kept set and every
    log-prob the trainer computes (π_θ, π_old, π_ref) is renormalised over it, log π(a) −
    log Σ_{b∈K} π(b), so the sampler and the trained policy share one action space and an
    on-policy importance ratio starts at exactly 1 (DeepSeek-V3.2 §3.1, "keep sampling mask").
    Costs 4 bytes per kept token per sampled token (top_k bounds it). false: the trainer's
    log-probs are over the whole vocabulary, and the gap to the engine's (log of the kept
    probability mass) shows in policy/engine_logprob_gap."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling: multiply each token's policy loss by min(π_old/π_rollout,
    C) with C ≥ 1 this cap (e.g. 2), correcting for the engine's log-probs differing from the
    trainer's (Yao et al. 2025); null: off. Only for policy losses ppo_clip and pg."""
    replay: str | None = None
    """A run's rollouts/ folder (written with record_rollouts: true): train on its recorded
    batches, step by step, instead of sampling and scoring; with the recorded run's config the
    losses repeat exactly. null: sample as usual."""
    max_staleness: int = Field(0, ge=0)
    """Asynchronous RL (AReaL, docs/algorithms.md §8.1): 0 is the synchronous loop. η ≥ 1: a
    producer thread with its own copy of the policy samples and scores batch k while the learner
    trains, using the weights of version max(0, k − 1 − η) (the learner's updates so far), so no
    sample is trained on more than η versions after the weights that sampled it, and a run
    repeats exactly (also across a resume). Policy losses anchor on the engine's log-probs (the
    policy that sampled); the decoupled loss (algorithm: areal) clips around the policy at the
    start of the step instead. Holds up to η + 1 copies of the trained weights."""
    producer: Literal["auto", "process", "thread"] = "auto"
    """With max_staleness ≥ 1, where the producer's engine decodes: "process", a child process
    sharing the copy's weights in CPU shared memory (Python's interpreter lock is not shared with
    the learner: the faster choice measured on a CPU); "thread", in the producer thread of this
    process (no process start-up; for models that cannot be handed to another process); "auto",
    process on the CPU and thread on a GPU (whose kernels do not hold the interpreter lock)."""
    producer_threads: int | None = Field(None, ge=1)
    """With max_staleness ≥ 1: torch threads of the producer (default: half of the run's
    threads, at least 1); the learner keeps the rest (at least 1)."""
    interrupt: bool = False
    """With max_staleness ≥ 1: a generation in flight switches to each new version of the
    weights at the next token (its KV cache computed again, never reused; docs/algorithms.md
    §8.2), and each batch starts with the newest weights at hand. Every token records the version
    that sampled it; a sample's age is that of its oldest token. Less stale data, but which token
    switches depends on timing, so a run does not repeat bit for bit (a resume still does)."""


class RLDataSection(DataSection):
    filter: DataFilterSection | None = None
    """Difficulty filtering before training: sample k completions (or episodes) of every training
    row from the starting policy and keep those whose pass rate lies in pass_rate (the rates are
    written to data_filter.json; a resume reads them). null: every row."""
    curriculum: CurriculumSection | None = None
    """Levels, easiest first: values or ranges of a data ``column`` (e.g. difficulty), or the
    ``task_options`` of a reasoning_gym task's levels; each step draws from the current level,
    which advances when the batch pass rate stays at ``advance_at`` for ``window`` steps
    (posttrain/data/curriculum.py). null: no levels."""

    @model_validator(mode="after")
    def _curriculum_varies_a_task(self) -> RLDataSection:
        curriculum = self.curriculum
        if curriculum is None or curriculum.column is not None:
            return self
        if self.path is not None or not str(self.task).startswith("reasoning_gym:"):
            raise ValueError(
                f"data.curriculum without a column varies data.task_options by level: it needs data.task = "
                f"reasoning_gym:<name> (data.task = {self.task!r}, data.path = {self.path!r}); to level rows by a "
                "column of the data, set data.curriculum.column"
            )
        return self


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
    """The reward-hacking alarm (train/hacking_alarm.py): with a monitor — a reward of weight 0 in
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
        raw = {**raw, "algorithm": {}}
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
