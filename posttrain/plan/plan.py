"""A run's memory plan from its resolved config, before any weights load: ``posttrain rl|sft|rm|dpo
... --plan`` prints it and exits, every run prints it first, and a run whose peak cannot fit the
device is refused with the key to change (``memory_model.py`` has the formulas).

The lengths come from the data as the run will see it: the longest prompt (RL) or example
(SFT, RM, DPO) in tokens of the run's tokenizer, over at most ``LENGTH_SAMPLE`` rows. On the
CPU the peak counts this process as it is (interpreter and libraries, measured) and is compared
with the machine's memory; on a GPU it is compared with the card's.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import PosttrainError
from posttrain.plan.memory_model import DTYPE_BYTES, MemoryPlan, ModelShape, Phase, ShapeUnknown, human, logits_bytes
from posttrain.rollout.products import packs_pay

LENGTH_SAMPLE = 2000  # rows whose lengths are measured (all of them when fewer)


class PlanDoesNotFit(PosttrainError):
    """The planned peak is more than the device has."""


def model_shape(section: Any) -> ModelShape:
    """The shape of ``model:``: a folder's config.json, or the tiny model's spec."""
    if section.path is not None:  # a folder, or a Hub id found in the cache (models/loading.py)
        from posttrain.models.loading import read_config

        return ModelShape.from_config(read_config(section.path))
    from posttrain.models.tokenizers import build_char_tokenizer

    spec = section.tiny
    return ModelShape(
        vocab=len(build_char_tokenizer()),
        hidden=spec.hidden,
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.heads,
        head_dim=spec.hidden // spec.heads,
        intermediate=spec.intermediate or 4 * spec.hidden,
        tied=False,
        qkv_bias=spec.arch == "qwen2",
    )


def _tokenizer(section: Any) -> Any:
    if section.path is not None:
        from posttrain.models.loading import load_tokenizer

        return load_tokenizer(section.path)
    from posttrain.models.tokenizers import build_char_tokenizer

    return build_char_tokenizer()


def _sample(rows: Sequence[dict], seed: int) -> Sequence[dict]:
    if len(rows) <= LENGTH_SAMPLE:
        return rows
    return random.Random(seed).sample(list(rows), LENGTH_SAMPLE)


def longest_prompt(tokenizer: Any, rows: Sequence[dict], column: str, seed: int = 0) -> int:
    """The longest prompt of ``rows`` in tokens, as the sampler sees it."""
    from posttrain.models.chat import prompt_ids

    longest = 1
    for row in _sample(rows, seed):
        try:
            longest = max(longest, len(prompt_ids(tokenizer, row[column])))
        except (KeyError, TypeError, PosttrainError):  # the run refuses such a row itself, naming it
            continue
    return longest


def longest_example(tokenizer: Any, rows: Sequence[dict], seed: int = 0) -> int:
    """The longest prompt + completion (or + the longer of chosen and rejected) in tokens."""
    longest = 1
    for row in _sample(rows, seed):
        try:
            longest = max(longest, _example_length(tokenizer, row))
        except (KeyError, TypeError, PosttrainError):  # the run refuses such a row itself, naming it
            continue
    return longest


def _example_length(tokenizer: Any, row: dict) -> int:
    from posttrain.models.chat import prompt_ids, render_chat

    def text(value: Any) -> str:
        return value if isinstance(value, str) else render_chat(tokenizer, value, add_generation_prompt=False)

    if "messages" in row:
        return len(prompt_ids(tokenizer, text(row["messages"])))
    prompt = len(prompt_ids(tokenizer, row.get("prompt", "")))
    answers = [row[key] for key in ("completion", "chosen", "rejected") if key in row]
    return prompt + max((len(prompt_ids(tokenizer, text(a))) for a in answers), default=0) + 1  # EOS


def _reward_model_shapes(rewards: Sequence[Any]) -> list[ModelShape]:
    """The reward models' shapes; one whose folder cannot be read is the run's own error, later."""
    from posttrain.models.loading import read_config

    shapes = []
    for spec in rewards:
        if isinstance(spec, dict) and spec.get("name") == "reward_model" and isinstance(spec.get("path"), str):
            try:
                shapes.append(ModelShape.from_config(read_config(spec["path"])))
            except (PosttrainError, ShapeUnknown):
                continue
    return shapes


def _activation_bytes(config: Any) -> int:
    return 2 if config.precision in ("bf16", "fp16") else DTYPE_BYTES[config.model.dtype]


def _trained(config: Any, shape: ModelShape) -> int:
    lora = config.model.lora
    return shape.lora_parameters(lora.r) if lora is not None else shape.parameters()


def _resident(config: Any, shape: ModelShape, *, reference: bool) -> Phase:
    """Weights, gradients (allocated from the start) and AdamW's moments of the trained model."""
    p, trained = DTYPE_BYTES[config.model.dtype], _trained(config, shape)
    parts = {"weights": shape.parameters() * p, "gradients": trained * p, "optimizer": trained * p * 2}
    if config.model.lora is not None:
        parts["adapters"] = trained * p
    if reference and config.model.lora is None:  # with LoRA the reference is the model, adapters off
        parts["reference"] = shape.parameters() * p
    return Phase("resident", parts)


def rl_plan(config: Any, shape: ModelShape, prompt_tokens: int, reward_models: Sequence[ModelShape] = ()) -> MemoryPlan:
    """The phases of an RL step: generation, log-probs (policy, reference, critic) and the update."""
    p, a = DTYPE_BYTES[config.model.dtype], _activation_bytes(config)
    engine = 2 if a == 2 and not _on_cpu(config) else p  # bf16 copies on an accelerator (rl_sources.py)
    lora = config.model.lora is not None
    resident = _resident(config, shape, reference=config.algorithm.kl.needs_reference)
    critic = _critic_shape(config, shape)
    if critic is not None:
        resident.parts["critic"] = _critic_bytes(config, critic, p)
    for index, scorer in enumerate(reward_models):
        head = 0 if scorer.tied else scorer.vocab * scorer.hidden  # a scorer has no output layer
        resident.parts[f"reward model {index + 1}"] = (scorer.parameters() - head) * 4
    length = prompt_tokens + config.max_new_tokens
    if config.env is not None:  # turns of the episode, each with a reply and what answers it
        length = config.env.max_total_tokens or prompt_tokens + 2 * config.env.max_turns * config.max_new_tokens
    rows = config.prompts_per_step * config.samples_per_prompt
    turns = config.env is not None and config.env.max_turns > 1
    generation = (prompt_tokens, length, engine, lora, turns, _packs(config, shape, engine))
    phases = [_generation("generation", shape, rows, config.prompts_per_step, *generation)]
    if config.eval_every and config.eval_size != 0:
        eval_rows = config.eval_batch_size
        phases.append(_generation("evaluation", shape, eval_rows, eval_rows, *generation))
    micro = micro_rows(config, config.minibatch_samples, length)
    tokens, response = micro * length, length - prompt_tokens
    # a group's prompt encoded once, its samples' responses reading its keys and values (a
    # checkpointed model keeps no cache, so it takes the full forward)
    shared = config.shared_prompt_forward and not config.model.gradient_checkpointing and config.env is None
    shared = shared and not config.padding_free  # a packed pass computes each sample's prompt
    if shared:
        groups = -(-micro // config.samples_per_prompt)
        tokens = groups * prompt_tokens + micro * response
    # forward passes without autograd: π_old (several updates a batch), π_ref, the critic's values
    policy_passes = config.recomputes_old_logprobs and not config.anchors_on_engine
    chunked = shape.plain_head and config.strategy != "fsdp2"  # models/logprobs.py output_layer
    if policy_passes or config.algorithm.kl.needs_reference:
        logits = logits_bytes(micro, response + 1, shape.vocab, a, with_gradient=False, chunked_head=chunked)
        phases.append(Phase("log-probs", {"activations": shape.layer_temporaries(tokens, a), "logits": logits}))
    checkpointing = config.model.gradient_checkpointing
    phases.append(
        Phase(
            "update",
            {
                "activations": shape.saved_activations(tokens, a, checkpointing) + shape.layer_temporaries(tokens, a),
                "logits": logits_bytes(micro, response, shape.vocab, a, with_gradient=True, chunked_head=chunked),
                "attention mask": 0 if config.padding_free else micro * length * length,
                "prompt keys and values": shape.kv_cache(micro, prompt_tokens, a) if shared else 0,
            },
        )
    )
    if critic is not None:  # its passes read whole sequences and have one output
        whole = micro * length
        phases.append(Phase("values", {"activations": critic.layer_temporaries(whole, a)}))
        saved = critic.saved_activations(whole, a, checkpointing) + critic.layer_temporaries(whole, a)
        phases.append(Phase("critic update", {"activations": saved, "attention mask": micro * length * length}))
    return MemoryPlan(resident, phases, _runtime(config), _transient_factor(config))


def _critic_bytes(config: Any, critic: ModelShape, p: int) -> int:
    """A full critic: a copy of the body (or the folder's) with a scalar head, trained in full
    (weights, gradients, two moments). A light one: its adapters and head trained, over the
    policy's base (shared) or a frozen copy of the body (models/value.py critic_for)."""
    body = critic.parameters() - (0 if critic.tied else critic.vocab * critic.hidden)
    adapters = config.critic_adapters
    if adapters is None:
        return body * p * 4
    shared = config.model.lora is not None and config.algorithm.critic.init_from is None
    return (critic.lora_parameters(adapters.r) + critic.hidden + 1) * p * 4 + (0 if shared else body * p)


def _critic_shape(config: Any, policy: ModelShape) -> ModelShape | None:
    """The critic's shape: the policy's, or that of the folder ``algorithm.critic.init_from`` names."""
    critic = config.algorithm.critic
    if critic is None:
        return None
    if critic.init_from is None:
        return policy
    from posttrain.models.loading import read_config

    return ModelShape.from_config(read_config(critic.init_from))


def micro_rows(config: Any, minibatch: int, length: int) -> int:
    """Rows per forward/backward pass: ``micro_batch_size``, or as many rows of ``length``
    tokens as ``micro_batch_tokens`` holds (at least one), or the whole minibatch."""
    rows = min(config.micro_batch_size or minibatch, minibatch)
    budget = getattr(config, "micro_batch_tokens", None)
    return max(1, min(rows, budget // length)) if budget else rows


def _generation(
    name: str, shape: ModelShape, rows: int, prompts: int, prompt_tokens: int, length: int, p: int, lora: bool,
    turns: bool = False, packs: bool = False,
) -> Phase:  # fmt: skip
    """The engine: its fused weights, the KV cache of every row, the prompts' prefill (one
    layer's temporaries and its attention bias) and a step's float32 logits; with ``turns`` (an
    episode's next turn) the keys and values its last turn kept (rollout/turn_cache.py); with
    ``packs`` the packed weights a CPU's decoding steps multiply by (rollout/products.py)."""
    extra = {"kept turn": shape.kv_cache(rows, length, p)} if turns else {}
    if packs:
        extra["engine packs"] = shape.engine_packs()
    return Phase(
        name,
        {
            "KV cache": shape.kv_cache(rows, length, p),
            **extra,
            "engine weights": shape.engine_copies(p, lora),
            "prefill": shape.layer_temporaries(prompts * prompt_tokens, p) + prompts * prompt_tokens**2 * p,
            "logits": 3 * rows * shape.vocab * 4,
        },
    )


def offline_plan(config: Any, command: str, shape: ModelShape, example_tokens: int) -> MemoryPlan:
    """The phases of an SFT, reward-model or DPO step: one micro-batch's forward and backward
    pass (chosen and rejected together for pairs; a DPO reference pass without autograd)."""
    a = _activation_bytes(config)
    length = config.max_length if getattr(config, "packing", False) and config.max_length else example_tokens
    pair = 2 if command in ("rm", "dpo") else 1  # chosen and rejected side by side
    examples = config.batch_size // config.gradient_accumulation
    if config.micro_batch_tokens:  # as many whole examples as the budget holds (train/micro_batches.py)
        examples = max(1, min(examples, config.micro_batch_tokens // (pair * length)))
    rows = examples * pair
    tokens = rows * length
    checkpointing = config.model.gradient_checkpointing
    resident = _resident(config, shape, reference=command == "dpo")
    vocab = 1 if command == "rm" else shape.vocab  # a scorer's head has one output
    # packed SFT rows run end to end with the output layer a chunk at a time (train/packing.py)
    packed = bool(getattr(config, "packing", False))
    chunked = packed and shape.plain_head and config.strategy != "fsdp2"
    step = {
        "activations": shape.saved_activations(tokens, a, checkpointing) + shape.layer_temporaries(tokens, a),
        "logits": logits_bytes(rows, length, vocab, a, with_gradient=True, chunked_head=chunked),
        "attention mask": 0 if packed else rows * length * length,
    }
    phases = [Phase("training step", step)]
    if command == "sft" and getattr(config, "eval_size", None) != 0:  # greedy answers to held-out prompts
        rows, p, lora = config.eval_batch_size, DTYPE_BYTES[config.model.dtype], config.model.lora is not None
        positions = length + config.eval_max_new_tokens  # the prompt taken as long as a whole example
        packs = _packs(config, shape, p)
        phases.append(_generation("evaluation", shape, rows, rows, length, positions, p, lora, packs=packs))
    return MemoryPlan(resident, phases, _runtime(config), _transient_factor(config))


CPU_TRANSIENT_FACTOR = 1.5  # measured: benchmarks/memory_plan.py's CPU cases need 1.15 (tiny models) to 1.7 (SmolLM2)
# measured: benchmarks/gpu_step.py's memory case on one H200 allocated 1.13 (LoRA) to 1.21 (full
# fine-tuning) times the phase the plan itemises (the kernels' own workspaces and saved tensors)
GPU_TRANSIENT_FACTOR = 1.2


def _packs(config: Any, shape: ModelShape, engine_bytes: int) -> bool:
    """Whether the native engine may pack the weights it decodes with (float32 on a CPU with MKL,
    weights that do not fit in cache, packs a small share of memory: rollout/products.py)."""
    if not _on_cpu(config):
        return False
    dtype = torch.float32 if engine_bytes == 4 else torch.bfloat16  # a 2-byte engine dtype is never packed
    return packs_pay(torch.device("cpu"), dtype, shape.hidden, shape.engine_packs())


def _on_cpu(config: Any) -> bool:
    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())


def _transient_factor(config: Any) -> float:
    """How much memory a phase takes per byte planned: on the CPU freed temporaries stay with the
    C allocator (resident memory); on a GPU the kernels allocate beyond the tensors itemised."""
    return CPU_TRANSIENT_FACTOR if _on_cpu(config) else GPU_TRANSIENT_FACTOR


def _runtime(config: Any) -> int:
    """On the CPU, this process's resident memory now (what the peak adds to); on a GPU, 0."""
    from posttrain.memory import resident_bytes

    return resident_bytes() if _on_cpu(config) else 0


def device_memory(device: torch.device, memory_gib: float | None = None) -> tuple[str, int | None]:
    """(what the plan calls the memory, the bytes one process may count on): ``memory_gib`` when
    set, a CUDA card's total memory, or the machine's physical memory shared by the processes
    torchrun started on it (None where it cannot be read)."""
    if memory_gib is not None:
        return "memory_gib allows", int(memory_gib * 2**30)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"GPU {props.name} has", int(props.total_memory)
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return (
            "this machine has" if processes == 1 else f"each of this machine's {processes} processes has"
        ), total // processes
    return "this machine has", None


def check_fits(plan: MemoryPlan, device: str, available: int | None, keys: str) -> None:
    """Refuse a run whose planned peak is more than the device has, naming what to lower."""
    if available is None or plan.peak <= available:
        return
    raise PlanDoesNotFit(
        f"this run needs about {human(plan.peak)} at its peak (the {plan.peak_phase.name}), more than the "
        f"{human(available)} {device}: lower {keys} (posttrain ... --plan shows each phase)"
    )


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is made from besides the config: read once, planned at any micro-batch."""

    command: str
    shape: ModelShape
    length: int  # RL: the longest prompt; SFT, RM, DPO: the longest example
    reward_models: tuple[ModelShape, ...] = ()


def plan_inputs(command: str, config: Any) -> PlanInputs:
    """Read the model's config, its tokenizer and the data (no weights)."""
    from posttrain.data.section import load_rows
    from posttrain.models.section import check_model_source

    check_model_source(config.model)  # the run's own message for a folder that cannot load
    shape, tokenizer = model_shape(config.model), _tokenizer(config.model)
    if command == "rl":
        rows, _, _ = load_rows(config.data, config.seed)
        prompt = longest_prompt(tokenizer, rows, config.data.prompt_column, config.seed)
        return PlanInputs(command, shape, prompt, tuple(_reward_model_shapes(config.rewards)))
    formats = {"sft": ("prompt_completion", "conversational"), "rm": ("preference",), "dpo": ("preference",)}
    rows, _, _ = load_rows(config.data, config.seed, formats[command])
    return PlanInputs(command, shape, longest_example(tokenizer, rows, config.seed))


def make_plan(inputs: PlanInputs, config: Any) -> MemoryPlan:
    if inputs.command == "rl":
        return rl_plan(config, inputs.shape, inputs.length, inputs.reward_models)
    return offline_plan(config, inputs.command, inputs.shape, inputs.length)


def plan_for(command: str, config: Any) -> tuple[MemoryPlan, str, int | None]:
    """The memory plan of ``posttrain <command>`` with ``config``, the device's name and its memory."""
    from posttrain.devices import resolve_device

    device, available = device_memory(resolve_device(config.device), config.memory_gib)
    return make_plan(plan_inputs(command, config), config), device, available
