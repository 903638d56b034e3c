"""posttrain: post-train language models with reinforcement learning.

The math lives in :mod:`posttrain.algos` (pure torch functions); everything else builds the
loop around it. Importing the package itself stays cheap: no transformers, ray or vllm here.

Where things go (one new file behind a seam, never a branch inside the loop):

=====================  ==================================================================
a new ...              goes in
=====================  ==================================================================
advantage estimator    ``algos/`` — ``@register_advantage("name", groups=..., values=...)``;
                       what it needs from a run is declared there, the loop reads it
policy loss            ``algos/`` — ``@register_policy_loss("name")``; ``weights`` and
                       ``proximal_logprobs`` parameters say it takes TIS / needs async
algorithm preset       ``presets/name.yaml`` (one estimator × loss × KL × aggregation)
reward function        ``rewards/`` — ``@register_reward("name")``, or any
                       ``pkg.module:fn`` with TRL's signature, named in ``rewards:``
task (generated data)  ``data/tasks/`` — ``@TASKS.register("name")``
rollout source         ``sources/`` — a :class:`~posttrain.sources.RolloutSource`: multi-
                       turn environments, replay, an async producer, Ray workers
data-side feature      ``sources/`` — a ``SourceWrapper`` (``sources/wrapper.py``) over any
                       sampling source, composed in ``train/rl_sources.py:data_side``
baseline               ``algos/`` — ``@register_baseline("name")`` (kept by the loop, or
                       played by the source: ``plays_greedy``)
environment            ``envs/`` — ``@register_environment("name")``, or any
                       ``pkg.module:Class``; the class shape is the contract in
                       docs/design.md (section "Next"); episodes are assembled by
                       ``envs/episode.py``; the source that plays them: ``sources/environment.py``
rollout engine         ``rollout/`` — generate ``Rollouts`` from token ids; built by
                       ``rollout/engine.py:build_engine``
model / data option    ``models/section.py`` / ``data/section.py`` (the ``model:`` and
                       ``data:`` config sections and what builds from them)
launcher (torchrun)    one module under ``train/``, wrapping the loop, not inside it
metric sink            ``telemetry/metrics.py`` (``report_to``)
run-keeping step       ``run/`` (folder, checkpoint, plain state, signals, outputs), shared by
                       both loops; it knows no loop, stage or algorithm
page over a run        ``view/`` (what ``posttrain view`` draws), or ``telemetry/report.py``
memory-plan phase      ``plan/plan.py``, from the config and the shapes; a number it needs
                       from the loop becomes an ``RLRun`` property, never a stage import
=====================  ==================================================================

Floors: imports go one way, ``algos → models → data → rollout → rewards → envs → evaluate →
run → sources → view → train → plan → cli`` over a ground of small modules (errors, config,
devices, distributed, ...); the sources never import the loop (docs/design.md, "Package layout";
tests/test_layout.py).

The RL loop is ``train/rl.py`` (run, save) with a file per stage: ``rl_sources.py`` (the wiring
of its source and data-side wrappers), ``rl_prepare.py`` (π_old, π_ref, values, token rewards,
advantages), ``rl_update.py`` (minibatches, accumulation, metrics); its config is
``train/rl_config.py`` (sections in ``rl_sections.py``). The offline loop behind
``sft``/``rm``/``dpo`` and the demo is ``train/offline.py``, its objectives ``train/sft.py`` and
``train/preference.py``, the commands' configs ``train/recipes.py``. Both loops keep their run
(folder, checkpoints, SIGTERM, outputs) with ``run/``; ``plan/`` sizes a run before it loads.
Formulas: docs/algorithms.md; design: docs/design.md.
"""

__version__ = "0.1.0"
