#!/usr/bin/env python
"""The decoding step on the hardware, a check as much as a benchmark. One JSON line per case.

* ``engine``: the native engine on a randomly initialised model of SmolLM2-135M's shape (30 ×
  576, 9/3 heads, vocabulary 49152; bf16 on a GPU), 64 / 256 / 1024 sequences × 128 new tokens,
  step by step against fixed-shape steps replayed as CUDA graphs, side by side: tokens/s, ms per
  decoding step, and the share of the memory-bandwidth bound (the weights plus the KV cache an
  ideal step reads, at the card's peak bandwidth); transformers ``generate`` once as a baseline.
* ``check``: correctness on the device, in float32 — the graphed engine's log-probs against a
  full forward pass; the same tokens and log-probs with and without graphs for one seed; the
  same seed twice; after an in-place update (an optimizer step) and after a rebound parameter,
  log-probs that match a full forward pass under the *new* weights; bf16 copies over float32
  weights (the engine–trainer gap, reported). Each line says ``passed``.
* ``grpo``: a realistic GRPO step (64 prompts × 8 samples × up to 128 tokens, precision bf16,
  full fine-tuning) as ``posttrain rl`` runs it by default, with 64 samples a pass, padding-free,
  and without graphs: step time, generation's share, the update's throughput as a share of the
  card's peak bf16 FLOP/s (6·N per generated token: a lower bound).
* ``memory``: the same step in float32 with no micro-batch bound, full fine-tuning and LoRA r16,
  sized as ``posttrain rl`` sizes it (the memory plan's derived ``micro_batch_tokens``): the
  plan's peak against the peak allocated on the card, step and update time.
* ``step_profile``: the top operators of a GRPO step (steps 2–3, sized as ``posttrain rl`` sizes
  it) by own device (and CPU) time — where the step's time goes.
* ``demo``: ``posttrain demo``'s wall time, closing lines and the median split of its RL step,
  its RL stage with graphs and without (``--demo``).

On the CPU the same cases run on a small model (the step runs eagerly there) as a smoke test:

    .venv/bin/python benchmarks/gpu_step.py --device cpu
    python benchmarks/gpu_step.py --device cuda --tokenizer .bench/smollm2-tokenizer --demo
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from timing import take_turns
from transformers import AutoModelForCausalLM, LlamaConfig

from posttrain.rollout.engine import LocalEngine
from posttrain.rollout.native import NativeDecoder
from posttrain.rollout.static_decode import StaticDecoding
from posttrain.rollout.types import Rollouts, SamplingParams

SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3}  # fmt: skip
SMALL = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# peak memory bandwidth (bytes/s) and dense bf16 FLOP/s of the SXM cards, by name
CARDS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}
RESULTS: list[dict] = []


OUTPUT: list[Path] = []  # the --output file, written line by line (a run cut short keeps what it had)


def emit(case: str, **fields: object) -> None:
    line = {"case": case, **fields}
    RESULTS.append(line)
    print(json.dumps(line), flush=True)
    for path in OUTPUT:
        with path.open("a") as out:
            out.write(json.dumps(line) + "\n")


def shaped_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    config = LlamaConfig(**shape, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         max_position_embeddings=2048, pad_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def token_ids(model: torch.nn.Module) -> SimpleNamespace:
    """A tokenizer stand-in: pad 0, and an EOS id no token has, so every row runs the full length."""
    return SimpleNamespace(pad_token_id=0, eos_token_id=model.config.vocab_size)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Ragged prompts of 16–48 random tokens."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (count,), generator=rng).tolist()
    return [torch.randint(2, vocab, (n,), generator=rng).tolist() for n in lengths]


def engine(
    model: torch.nn.Module, graphs: bool | None, dtype: torch.dtype | None = None, compiled: bool = False
) -> LocalEngine:
    """The native engine: step by step (``graphs`` None), or fixed-shape steps, graphed or eager,
    their layers compiled or not (``rollout.compile_step``)."""
    decoder = NativeDecoder(model, dtype=dtype)
    static = None if graphs is None else StaticDecoding(decoder, graphs=graphs, compiled=compiled)
    return LocalEngine(model, token_ids(model), decoder, static=static)


def full_forward_gap(model: torch.nn.Module, out: Rollouts) -> tuple[float, float]:
    """max and mean |engine log-prob − log_softmax(full forward)| over the response tokens."""
    device = next(model.parameters()).device
    ids = torch.cat([out.prompt_ids, out.response_ids], 1).to(device)
    mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    width = out.prompt_ids.shape[1]
    full = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(-1, out.response_ids.to(device)[..., None])
    gap = (full.squeeze(-1).cpu() - out.logprobs).abs()[out.response_mask.bool()]
    return float(gap.max()), float(gap.mean())


def card(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return f"CPU, {torch.get_num_threads()} threads", None, None
    name = torch.cuda.get_device_name(device)
    bandwidth, flops = next((v for k, v in CARDS.items() if k in name), (None, None))
    return name, bandwidth, flops


def step_bytes(model: torch.nn.Module, rows: int, context: float) -> float:
    """Bytes an ideal decoding step reads: every weight once, and each row's keys and values."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    return weights + rows * context * kv_per_token * next(model.parameters()).element_size()


def case_engine(args: argparse.Namespace, device: torch.device, bandwidth: float | None) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = shaped_model(args.shape, dtype, device)
    fast = "graphs" if device.type == "cuda" else "fixed_shape"  # a CPU runs the fixed-shape step eagerly
    sides = {
        "step_by_step": engine(model, None),
        fast: engine(model, device.type == "cuda"),
        f"{fast}_compiled": engine(model, device.type == "cuda", compiled=True),
    }
    new = args.new_tokens
    for rows in args.rows:
        batch = prompts(rows // 8, model.config.vocab_size)
        sampling = SamplingParams(n=8, max_new_tokens=new, seed=0)
        calls = {k: (lambda e=e, b=batch, s=sampling: e.generate(b, s)) for k, e in sides.items()}
        seconds = take_turns(calls, args.repeats)  # warmed up first: the compile is not timed
        context = statistics.mean(map(len, batch)) + new / 2
        for name, s in seconds.items():
            share = None if bandwidth is None else step_bytes(model, rows, context) / bandwidth / (s / new)
            emit("engine", engine=name, rows=rows, new_tokens=new, seconds=round(s, 4),
                 tokens_per_s=round(rows * new / s), ms_per_step=round(s / new * 1e3, 3),
                 bandwidth_share=None if share is None else round(share, 3))  # fmt: skip
        base = seconds["step_by_step"]
        emit("engine", rows=rows, speedup=round(base / seconds[fast], 2),
             speedup_compiled=round(base / seconds[f"{fast}_compiled"], 2))  # fmt: skip
    batch = prompts(8, model.config.vocab_size)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in batch], batch_first=True).flip(1)
    mask = (ids != 0).long()

    def generate():
        with torch.no_grad():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=True, num_return_sequences=8, pad_token_id=0)  # fmt: skip

    seconds = take_turns({"generate": generate}, max(1, args.repeats // 2))["generate"]
    emit("engine", engine="transformers_generate", rows=64, new_tokens=new, tokens_per_s=round(64 * new / seconds))


def case_profile(args: argparse.Namespace, device: torch.device) -> None:
    """Where a fixed-shape step's device time goes at the largest batch (run eagerly: the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    model = shaped_model(args.shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    fixed, rows = engine(model, graphs=False), args.rows[-1]
    batch, sampling = prompts(rows // 8, model.config.vocab_size), SamplingParams(n=8, max_new_tokens=32, seed=0)
    fixed.generate(batch, sampling)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as trace:
        fixed.generate(batch, sampling)
    events = trace.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:14]
    total = sum(getattr(e, key, 0) for e in events)
    emit("profile", rows=rows, steps=32, total_ms=round(total / 1e3, 1),
         top=[[e.key[:60], round(getattr(e, key, 0) / 1e3, 2), e.count] for e in top])  # fmt: skip


def check(name: str, passed: bool, **fields: object) -> None:
    emit("check", check=name, passed=bool(passed), **fields)


def case_checks(args: argparse.Namespace, device: torch.device) -> None:
    model = shaped_model(args.shape, torch.float32, device, seed=1)
    graphs = device.type == "cuda"
    graphed, eager = engine(model, graphs), engine(model, False)
    batch = prompts(16, model.config.vocab_size, seed=1)
    sampling = SamplingParams(n=4, max_new_tokens=32, seed=7)
    out = graphed.generate(batch, sampling)
    worst, mean = full_forward_gap(model, out)
    check("logprobs_vs_full_forward", worst <= args.tolerance, max_abs=worst, mean_abs=mean)
    same = eager.generate(batch, sampling)
    gap = float((same.logprobs - out.logprobs).abs().max())
    check("graph_equals_eager", torch.equal(same.response_ids, out.response_ids) and gap <= 1e-6, max_abs=gap)
    check("same_seed_same_tokens", torch.equal(graphed.generate(batch, sampling).response_ids, out.response_ids))
    # a sixteenth of the vocabulary ends a response: rows stop at different steps and the
    # survivors are gathered into smaller buckets (other graphs) as the batch runs
    stopping = SamplingParams(
        n=4, max_new_tokens=48, seed=3, stop_token_ids=tuple(range(2, args.shape["vocab_size"] // 16))
    )
    out, same = graphed.generate(batch, stopping), eager.generate(batch, stopping)
    gap = float((same.logprobs - out.logprobs).abs().max())
    equal = torch.equal(same.response_ids, out.response_ids) and same.finish_reasons == out.finish_reasons
    check("graph_equals_eager_with_stops", equal and gap <= 1e-6 and "stop" in out.finish_reasons, max_abs=gap,
          lengths=sorted(out.response_lengths.tolist())[:: max(1, len(out) // 8)])  # fmt: skip
    out = graphed.generate(batch, sampling)
    with torch.no_grad():  # what an optimizer step does: write every weight in place
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    captures = graphed.static.captures
    after = graphed.generate(batch, sampling)
    worst, _ = full_forward_gap(model, after)
    changed = not torch.equal(after.response_ids, out.response_ids)
    check("in_place_update_seen", worst <= args.tolerance and changed and graphed.static.captures == captures,
          max_abs=worst)  # fmt: skip
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 1.5)  # a rebound parameter: graphs must be recaptured
    rebound = graphed.generate(batch, sampling)
    worst, _ = full_forward_gap(model, rebound)
    recaptured = graphed.static.captures > captures or not graphs
    check("rebound_parameter_seen", worst <= args.tolerance and recaptured, max_abs=worst)
    turn_cache_check(graphed, eager, batch, stopping, args.tolerance)
    compiled_checks(model, graphs, batch, stopping, args.tolerance)
    shadow = engine(model, graphs, dtype=torch.bfloat16)
    worst, mean = full_forward_gap(model, shadow.generate(batch, sampling))
    check("bf16_copies_gap", mean < 0.05, max_abs=worst, mean_abs=mean)
    packed_checks(model, shadow.generate(batch, sampling))


def compiled_checks(model: torch.nn.Module, graphs: bool, batch: list, stopping: SamplingParams, tolerance: float):
    """The step compiled (and graphed on a GPU) samples the eager step's tokens, and sees an update."""
    compiled, eager = engine(model, graphs, compiled=True), engine(model, False)
    out, same = compiled.generate(batch, stopping), eager.generate(batch, stopping)
    gap = float((same.logprobs - out.logprobs).abs().max())
    equal = torch.equal(same.response_ids, out.response_ids) and same.finish_reasons == out.finish_reasons
    check("compiled_equals_eager_with_stops", equal and gap <= 1e-5, max_abs=gap)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    worst, _ = full_forward_gap(model, compiled.generate(batch, stopping))
    check("compiled_update_seen", worst <= tolerance, max_abs=worst)


def turn_cache_check(graphed: LocalEngine, eager: LocalEngine, batch: list, first: SamplingParams, tolerance: float):
    """A second turn that reuses the first's kept keys and values (rollout/turn_cache.py; rows
    copied out of the graphed buckets as they shrink) against the eager engine encoding it all."""
    turn = graphed.generate(batch, SamplingParams(**{**first.__dict__, "keep_cache": True}))
    replies = [turn.response_ids[row, : int(n)].tolist() for row, n in enumerate(turn.response_lengths)]
    second = [batch[row // first.n] + reply + [5, 6, 7] for row, reply in enumerate(replies)]
    sampling = SamplingParams(max_new_tokens=16, greedy=True)
    reused, encoded = graphed.generate(second, sampling), graphed.decoder.prefilled_tokens
    full = eager.generate(second, sampling)
    gap = float((reused.logprobs - full.logprobs).abs().max())
    passed = torch.equal(reused.response_ids, full.response_ids) and gap <= tolerance and encoded < 8 * len(second)
    check("turn_cache_equals_a_full_prefill", passed, max_abs=gap, encoded=encoded, full=sum(map(len, second)))


def packed_checks(model: torch.nn.Module, out: Rollouts) -> None:
    """Padding-free passes (models/packing.py) against the padded pass on the device: log-probs and
    gradients in float32, log-probs under bf16 autocast (the kernels differ: jagged attention)."""
    from posttrain.devices import compute_precision
    from posttrain.models.logprobs import response_logprobs
    from posttrain.models.packing import _jagged_attention, _per_document, packed_logprobs

    device = next(model.parameters()).device
    if device.type == "cuda":  # the jagged kernel against one call per document, values and gradients
        g = torch.Generator(device=device).manual_seed(0)
        bounds = ((0, 37), (37, 40), (40, 140), (140, 141))
        offsets = torch.tensor([0, 37, 40, 140, 141], device=device)
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, 9, 141, 64, device=device, dtype=dtype, generator=g).requires_grad_()
            k, v = (torch.randn(1, 3, 141, 64, device=device, dtype=dtype, generator=g).requires_grad_() for _ in "kv")
            outs = [_jagged_attention(q, k, v, offsets, 100, None), _per_document(q, k, v, bounds, None, None)]
            grads = [torch.autograd.grad(o.float().square().sum(), (q, k, v)) for o in outs]
            gap = float((outs[0] - outs[1]).detach().abs().max())
            grad_gap = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
            limit = 1e-4 if dtype == torch.float32 else 3e-2
            check(f"jagged_attention_{str(dtype)[6:]}", gap <= limit and grad_gap <= 10 * limit, max_abs=gap,
                  grad_max_abs=grad_gap)  # fmt: skip
    mask = out.response_mask.float().to(device)
    prompt_ids, prompt_mask = out.prompt_ids.to(device), out.prompt_mask.to(device)
    response_ids = out.response_ids.to(device)
    ids, attention = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, mask.long()], 1)
    for precision in ("fp32", "bf16"):
        with compute_precision(precision, device):
            padded, _ = response_logprobs(model, ids, attention, response_mask=mask)
            packed, _ = packed_logprobs(model, prompt_ids, prompt_mask, response_ids, mask, mask.long().sum(1))
        gap = float((padded - packed).detach().abs().max())
        fields = {"max_abs": gap, "tokens": int(mask.sum())}
        if precision == "fp32":
            params = [p for p in model.parameters() if p.requires_grad]
            grads = [torch.autograd.grad(x.sum(), params) for x in (padded, packed)]
            worst = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(*grads, strict=True))
            fields["grad_rel_gap"] = worst
        limit = 5e-4 if precision == "fp32" else 0.1
        check(f"packed_equals_padded_{precision}", gap <= limit and fields.get("grad_rel_gap", 0) <= 1e-3, **fields)


def letter_share(prompts: list, completions: list, **columns: object) -> list[float]:
    """A reward with spread even for a random model: the share of letters in the completion."""
    return [sum(ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]


def grpo_model(args: argparse.Namespace) -> tuple[Path, int]:
    """A folder holding the random model of ``args.shape`` and a tokenizer; its parameter count."""
    folder = Path(tempfile.mkdtemp(prefix="gpu_step-"))
    model = shaped_model(args.shape, torch.float32, torch.device("cpu"))
    model.save_pretrained(folder / "model")
    if args.tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(folder / "model")
    else:  # the character tokenizer of the tiny examples (its ids sit inside the vocabulary)
        from posttrain.models.tokenizers import build_char_tokenizer

        build_char_tokenizer().save_pretrained(folder / "model")
    return folder / "model", sum(p.numel() for p in model.parameters())


def grpo_config(args: argparse.Namespace, device: torch.device, model: Path, graphs: bool, steps: int, *extra: str):
    """The realistic GRPO step's config (a reward with spread even for a random model)."""
    from posttrain.train.rl_config import load_rl_config

    micro = min(64, 8 * args.prompts)  # samples per forward/backward pass
    out = model.parent / f"run-{sum(1 for _ in model.parent.iterdir())}"  # a fresh folder per run
    overrides = [f"model.path={model}", "data.task=reverse", "data.n_train=2048", "data.n_eval=9",
                 "eval_size=0", "algorithm=grpo", f"steps={steps}", f"prompts_per_step={args.prompts}",
                 "samples_per_prompt=8", f"max_new_tokens={args.new_tokens}", f"micro_batch_size={micro}",
                 "rewards=[gpu_step:letter_share]", "sampling.stop=[]", "reward_workers=0", "preflight=false",
                 "log_every=1000", f"device={device}", f"precision={args.precision}", "report_to=[]",
                 f"rollout.cuda_graphs={str(graphs).lower()}", f"output_dir={out}", *extra]  # fmt: skip
    return load_rl_config(None, overrides)


def plan_sized_run(args: argparse.Namespace, device: torch.device, model: Path, graphs: bool, steps: int):
    """The realistic GRPO step's run as ``posttrain rl`` sizes it by default (micro-batches from
    the memory plan), ready to ``run()``."""
    from posttrain.plan.announce import announce_plan
    from posttrain.train.rl import OnlineRL

    config = grpo_config(args, device, model, graphs, steps, "micro_batch_size=null")
    return OnlineRL(announce_plan("rl", config, echo=False), echo=lambda line: None)


def case_memory(args: argparse.Namespace, device: torch.device) -> None:
    """The GRPO step in float32 with no micro-batch bound, full fine-tuning and LoRA r16, sized as
    ``posttrain rl`` sizes it (the memory plan's derived ``micro_batch_tokens``): the planned peak
    against the peak allocated on the card (on the CPU: the process's peak RSS so far)."""
    import resource

    from posttrain.plan.announce import announce_plan
    from posttrain.plan.plan import plan_for
    from posttrain.train.rl import OnlineRL

    model, _ = grpo_model(args)
    variants = {"full": [], "lora_r16": ["model.lora={r: 16, alpha: 32}"], "full_packed": ["padding_free=true"]}
    for name, extra in variants.items():
        extra = ["precision=fp32", "micro_batch_size=null", *extra]
        config = announce_plan("rl", grpo_config(args, device, model, True, args.grpo_steps, *extra), echo=False)
        plan, _, available = plan_for("rl", config)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            timed = OnlineRL(config, echo=lambda line: None).run()[1:]
        except Exception as error:  # an out-of-memory error is a finding: the next variant still runs
            why = f"{type(error).__name__}: {error}"[:600]
            emit("memory", variant=name, micro_batch_tokens=config.micro_batch_tokens,
                 planned_peak_gib=round(plan.peak / 2**30, 2), error=why)  # fmt: skip
            continue
        if device.type == "cuda":
            measured = torch.cuda.max_memory_allocated(device)
        else:
            measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        emit("memory", variant=name, micro_batch_tokens=config.micro_batch_tokens,
             planned_peak_gib=round(plan.peak / 2**30, 2), measured_peak_gib=round(measured / 2**30, 2),
             planned_over_measured=round(plan.peak / measured, 3), device_gib=round((available or 0) / 2**30, 1),
             step_s=round(statistics.median(h["time/step_s"] for h in timed), 3),
             update_s=round(statistics.median(h["time/train_s"] for h in timed), 3))  # fmt: skip


# (CUDA graphs, overrides): the step as `posttrain rl` runs it by default (micro-batches sized by
# the memory plan), then with 64 samples a pass (the first figures' setting), padding-free, and
# generation step by step
GRPO_VARIANTS = {
    "graphs": (True, ["micro_batch_size=null"]),
    "graphs_micro64": (True, []),
    "graphs_packed": (True, ["micro_batch_size=null", "padding_free=true"]),
    "step_by_step": (False, []),
}


def case_grpo(args: argparse.Namespace, device: torch.device, flops: float | None) -> None:
    from posttrain.plan.announce import announce_plan
    from posttrain.train.rl import OnlineRL

    model, params = grpo_model(args)
    for variant in args.grpo_variants:
        graphs, extra = GRPO_VARIANTS[variant]
        config = announce_plan("rl", grpo_config(args, device, model, graphs, args.grpo_steps, *extra), echo=False)
        timed = OnlineRL(config, echo=lambda line: None).run()[1:]
        step = statistics.median(h["time/step_s"] for h in timed)
        generate = statistics.median(h["time/generate_s"] for h in timed)
        update = statistics.median(h["time/train_s"] for h in timed)
        # a lower bound: 6·N FLOPs per generated token (the prompts' tokens are left out)
        tokens = statistics.median(h["throughput/generated_tokens_per_s"] * h["time/generate_s"] for h in timed)
        share = None if flops is None else 6 * params * tokens / update / flops
        emit("grpo", variant=variant, micro_batch_tokens=config.micro_batch_tokens,
             micro_batch_size=config.micro_batch_size, step_s=round(step, 3), generate_s=round(generate, 3),
             generate_share=round(generate / step, 3), update_s=round(update, 3),
             update_flops_share=None if share is None else round(share, 3),
             times={k: round(v, 3) for k, v in timed[-1].items() if k.startswith("time/")})  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()


def case_step_profile(args: argparse.Namespace, device: torch.device) -> None:
    """Where a GRPO step's time goes (graphs on, sized as ``posttrain rl`` sizes it): the top
    operators by own device (and CPU) time over steps 2 and 3 — the first, which captures the
    graphs, and the run's start and end (checkpoint, report) are left out."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = grpo_model(args)
    run = plan_sized_run(args, device, model, graphs=True, steps=3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    plain_step, traces = run.step, []

    def profiled_step(step: int):
        if step == 1:
            return plain_step(step)
        with profile(activities=activities) as trace:
            out = plain_step(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        traces.append(trace)
        return out

    run.step = profiled_step
    run.run()
    for key in ("self_device_time_total", "self_cpu_time_total")[device.type != "cuda" :]:
        totals: dict[str, list[float]] = {}
        for trace in traces:
            for e in trace.key_averages():
                entry = totals.setdefault(e.key[:60], [0.0, 0])
                entry[0], entry[1] = entry[0] + getattr(e, key, 0) / len(traces), entry[1] + e.count / len(traces)
        top = sorted(totals.items(), key=lambda item: -item[1][0])[:18]
        emit("step_profile", by=key, per_step_ms=round(sum(v[0] for v in totals.values()) / 1e3, 1),
             top=[[name, round(ms / 1e3, 1), round(count)] for name, (ms, count) in top])  # fmt: skip


def case_host_profile(args: argparse.Namespace, device: torch.device) -> None:
    """Where the host's time goes in a 3-step GRPO run (cProfile, graphs on): posttrain's functions
    by cumulative time — what a step waits on when the card is idle."""
    import cProfile
    import pstats

    model, _ = grpo_model(args)
    profiler = cProfile.Profile()
    profiler.runcall(plan_sized_run(args, device, model, graphs=True, steps=3).run)
    stats = pstats.Stats(profiler).stats
    own = [(f"{Path(f).name}:{line}:{name}"[:70], round(c[3], 2), c[1]) for (f, line, name), c in stats.items()
           if "posttrain" in f or "transformers" in f or "torch/nn" in f]  # fmt: skip
    emit("host_profile", top=sorted(own, key=lambda row: -row[1])[:40])


def case_demo(args: argparse.Namespace, graphs: bool) -> None:
    """``posttrain demo`` on the default device, its RL stage with or without CUDA graphs."""
    folder = tempfile.mkdtemp(prefix="gpu_step-demo-")
    command = [
        sys.executable,
        "-m",
        "posttrain",
        "demo",
        "--output-dir",
        folder,
        f"rollout.cuda_graphs={str(graphs).lower()}",
    ]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.demo_timeout)
    lines = [line for line in run.stdout.splitlines() if line.strip()][-4:]
    emit("demo", graphs=graphs, seconds=round(time.perf_counter() - start, 1), returncode=run.returncode,
         closing=lines, rl_step_times=median_times(Path(folder) / "rl" / "metrics.jsonl"),
         stderr=run.stderr[-800:] if run.returncode else "")  # fmt: skip


def median_times(metrics: Path) -> dict[str, float]:
    """The median of every ``time/…`` metric over a run's logged steps (where a step's time goes)."""
    if not metrics.exists():
        return {}
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"time/step_s"' in line]
    keys = sorted({k for step in steps for k in step if k.startswith("time/")})
    return {k: round(statistics.median(s[k] for s in steps if k in s), 4) for k in keys}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    choices = ["check", "engine", "profile", "grpo", "step_profile", "host_profile", "memory"]
    parser.add_argument("--cases", nargs="+", default=["check", "engine", "grpo"], choices=choices)
    parser.add_argument("--demo", action="store_true", help="also time `posttrain demo`, with graphs and without")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder for the GRPO step (SmolLM2's)")
    parser.add_argument("--precision", default=None, help="the GRPO step's (default: bf16 on a GPU, fp32 on the CPU)")
    parser.add_argument("--output", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--demo-timeout", type=float, default=240)
    parser.add_argument("--grpo-variants", nargs="+", default=list(GRPO_VARIANTS), choices=list(GRPO_VARIANTS))
    parser.add_argument("--no-demo-baseline", action="store_true", help="time the demo with graphs only")
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    args.shape = SMOLLM2 if gpu else SMALL
    args.rows, args.new_tokens = ((64, 256, 1024), 128) if gpu else ((8, 32), 16)
    args.repeats, args.prompts, args.grpo_steps = (3, 64, 3) if gpu else (2, 4, 2)
    args.tolerance = 5e-4 if gpu else 1e-5  # float32; a GPU's kernels differ between decode and a full pass
    args.precision = args.precision or ("bf16" if gpu else "fp32")
    return args


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    name, bandwidth, flops = card(device)
    emit("device", name=name, torch=torch.__version__)
    cases = {"check": lambda: case_checks(args, device), "engine": lambda: case_engine(args, device, bandwidth),
             "profile": lambda: case_profile(args, device), "grpo": lambda: case_grpo(args, device, flops),
             "step_profile": lambda: case_step_profile(args, device),
             "host_profile": lambda: case_host_profile(args, device),
             "memory": lambda: case_memory(args, device)}  # fmt: skip
    if args.demo:
        cases["demo"] = lambda: case_demo(args, graphs=True)
        cases["demo_baseline"] = lambda: case_demo(args, graphs=False)
    if args.output:
        OUTPUT.append(Path(args.output))
        Path(args.output).write_text("")
    demos = ["demo"] if args.no_demo_baseline else ["demo", "demo_baseline"]
    for case in [*args.cases, *(demos if args.demo else [])]:
        try:
            cases[case]()
        except Exception as error:  # one broken case must not hide the others' figures
            emit(case, error=f"{type(error).__name__}: {error}")
    failed = [r for r in RESULTS if r.get("passed") is False or "error" in r]
    print(f"{len(failed)} failed" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
