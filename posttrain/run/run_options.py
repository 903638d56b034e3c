"""The options every training command shares, declared once: how a run is kept (its folder,
checkpoints, logs, resume, device, seed) and how its optimizer steps (AdamW and the rate's
schedule). ``LoopConfig`` (``sft``, ``rm``, ``dpo``) and ``RLRun`` (``rl``) are both made of these
two sections plus their own options; where their defaults differ (RL's rate, steps, warm-up and
folder), the RL config changes the default only (:func:`posttrain.config.with_default`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config import Beta, Section
from posttrain.devices import DeviceName, Precision


class OptimizerOptions(Section):
    """AdamW and its learning-rate schedule (the policy's, in RL)."""

    learning_rate: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate (of the policy, in rl)."""
    lr_scheduler: Literal["constant_with_warmup", "cosine", "linear"] = "constant_with_warmup"
    """Shape after warm-up. Constant by default: SFT before RL stops part-way on purpose, and a
    rate annealed to 0 there leaves a flat policy that RL gets no signal from."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up, in optimizer steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final rate of cosine/linear schedules as a fraction of the peak."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    adam_betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW β₁, β₂."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (the policy's, in rl) to this; null turns clipping off."""


class RunOptions(Section):
    """How a run is kept: its steps, seed, device, folder, checkpoints, logs and resume."""

    steps: int = Field(300, ge=1)
    """Optimizer steps (sft, rm, dpo), or RL steps of one rollout batch each (rl)."""
    seed: int = Field(0, ge=0)
    """Seeds the data order, the initial weights of models built here, and sampling: the same
    seed repeats a run."""
    device: DeviceName = "auto"
    """Where the models compute: auto (the first CUDA GPU when one is visible, else the CPU), cpu,
    cuda, cuda:N or mps. RL's rollout batches stay on the CPU; each micro-batch moves there for its pass."""
    memory_gib: float | None = Field(None, gt=0)
    """Memory this run may count on, in GiB per process (default: the device's — a GPU's total, or
    this machine's memory shared by its processes). The memory plan is checked against it and
    the default micro-batch (micro_batch_tokens) is sized from it."""
    precision: Precision = "fp32"
    """fp32, or bf16: forward passes under bfloat16 autocast over float32 master weights and
    optimizer state, losses in float32 (needs model.dtype: float32). Generation keeps the
    weights' dtype."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun: ddp, every process holds the whole model and the gradients are summed;
    fsdp2, weights, gradients and optimizer state are sharded over the processes (FSDP2's
    fully_shard per transformer block; in rl the policy, reference and critic, each process
    generating with a whole copy of the policy refreshed after every update), for a model whose
    training state does not fit one device. One process: no difference."""
    output_dir: str = "runs/train"
    """Run directory: config.yaml, metrics.jsonl (rl: samples.jsonl), checkpoints/, final/, report.html."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every this many steps (0: only at the end)."""
    stop_grace_s: float = Field(20.0, gt=0)
    """On SIGTERM (Slurm, Kubernetes), seconds to end the current step and save it before the step
    is abandoned instead; either way the run stops with exit status 143 (run/stopping.py)."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; the newest is never deleted."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out rows every this many steps (0: only before and after training)."""
    log_every: int = Field(10, ge=1)
    """Print a progress line every this many steps when not on a terminal."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=lambda: ["tensorboard"])
    """Where metrics go besides metrics.jsonl: TensorBoard (output_dir/tensorboard, when installed)
    and/or Weights & Biases (pip install wandb; project from WANDB_PROJECT, else "posttrain"; a
    resumed run continues the same W&B run; WANDB_MODE=offline keeps it local)."""
    run_name: str | None = None
    """The run's name in W&B (default: the output_dir's folder name)."""
    resume: str = "none"
    """"auto": continue from the newest checkpoint in output_dir that verifies (saying which newer
    ones were skipped; step 0 when there is none yet); a path: from that checkpoint; "none": a new
    run, refused when output_dir already holds one (see overwrite)."""
    overwrite: bool = False
    """With resume "none": delete the run already in output_dir (checkpoints, final model, logs,
    report) and start over, instead of refusing."""
