"""``device`` and ``precision`` (devices.py): names checked when the config is read, a device
this machine lacks refused before anything loads, and bf16 mixed precision on the CPU: forward
passes in bfloat16, master weights, optimizer state and losses in float32."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.devices import DeviceError, compute_precision, resolve_device
from posttrain.train.recipes import SFTRun, run_sft
from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config
from posttrain.train.rl_sources import producer_kind
from tests.sources.test_async_producer import vowel_share

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
RL = [*TINY, "data.task=reverse", "data.n_train=32", "data.n_eval=9", "eval_size=0", "prompts_per_step=4",
      "samples_per_prompt=4", "max_new_tokens=6", "reward_workers=0", "log_every=100", "algorithm=grpo"]  # fmt: skip
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_is_cuda_when_present_else_cpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@NO_CUDA
def test_an_absent_device_is_refused_with_what_to_set():
    with pytest.raises(DeviceError, match=r"device = 'cuda'.*set device: cpu"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match=r"device = 'cuda:1'"):
        resolve_device("cuda:1")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceError, match=r"device = 'mps'.*Metal"):
            resolve_device("mps")


def test_a_producer_process_is_refused_off_the_cpu_and_auto_picks_a_thread():
    config = load_rl_config(None, [*RL, "rollout.max_staleness=1"])
    assert producer_kind(config, torch.device("cpu")) == "process"
    assert producer_kind(config, torch.device("cuda")) == "thread"
    explicit = load_rl_config(None, [*RL, "rollout.max_staleness=1", "rollout.producer=process"])
    with pytest.raises(ConfigError, match=r"rollout\.producer = 'process'.*cuda.*thread"):
        producer_kind(explicit, torch.device("cuda"))


def test_bf16_autocast_computes_in_bfloat16_on_the_cpu():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with compute_precision("bf16", torch.device("cpu")):
        assert layer(x).dtype == torch.bfloat16
    with compute_precision("fp32", torch.device("cpu")):
        assert layer(x).dtype == torch.float32


def test_training_passes_on_cuda_never_pick_cudnn_attention():
    """cuDNN's attention rebuilds a graph per shape (a training pass's shape changes each
    micro-batch); the flags are read, not a GPU, so this holds on any machine."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with compute_precision("fp32", torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with compute_precision("fp32", torch.device("cpu")):  # the CPU's own kernels: nothing to choose
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_a_bf16_grpo_run_trains_in_mixed_precision_on_the_cpu(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        config = load_rl_config(
            None, [*RL, "steps=2", "device=cpu", f"precision={precision}", f"output_dir={tmp_path / precision}"]
        )
        run = OnlineRL(config, reward_functions=[vowel_share], echo=lambda line: None)
        seen: list[torch.dtype] = []
        # the language-model head's output in passes that build a graph: the update's forward
        hook = run.policy.lm_head.register_forward_hook(
            lambda module, inputs, output, seen=seen: seen.append(output.dtype) if torch.is_grad_enabled() else None
        )
        history = run.run()
        hook.remove()
        assert seen and set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert all(math.isfinite(h["loss/policy"]) and h["policy/grad_norm"] > 0 for h in history)
        # master weights and the optimizer's moments stay float32
        assert {p.dtype for p in run.policy.parameters()} == {torch.float32}
        moments = [s["exp_avg"] for s in run.optimizer.state.values()]
        assert moments and {m.dtype for m in moments} == {torch.float32}
        runs[precision] = history
    # the same samples (generation keeps float32 weights) and a loss computed in another precision
    assert runs["fp32"][0]["reward/mean"] == runs["bf16"][0]["reward/mean"]
    assert runs["fp32"][0]["policy/grad_norm"] != runs["bf16"][0]["policy/grad_norm"]


def test_a_bf16_sft_run_on_the_cpu(tmp_path):
    losses = {}
    for precision in ("fp32", "bf16"):
        config = SFTRun.model_validate(
            {
                "model": {"tiny": {"layers": 1, "hidden": 32, "heads": 2}},
                "data": {"task": "reverse", "n_train": 32, "n_eval": 9},
                "eval_size": 0,
                "steps": 3,
                "batch_size": 8,
                "device": "cpu",
                "precision": precision,
                "output_dir": str(tmp_path / precision),
                "report_to": [],
            }
        )
        history = run_sft(config)
        losses[precision] = [h["loss/sft"] for h in history]
        assert all(math.isfinite(loss) for loss in losses[precision])
    assert losses["fp32"] != losses["bf16"]
    assert losses["fp32"][0] == pytest.approx(losses["bf16"][0], rel=0.05)  # the same start, coarser arithmetic
