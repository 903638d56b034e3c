"""A policy with gradient checkpointing is scored like one without: its training forward cannot
use the shared-prompt KV cache (transformers runs a checkpointed model in training mode without a
cache), which made the responses blind to their prompts — kl/ref 1.19 nats/token at step 1 of a
SmolLM2 LoRA run, where the policy still equals its reference."""

from __future__ import annotations

import pytest

from posttrain.train.rl import OnlineRL
from posttrain.train.rl_config import load_rl_config

TINY = ["model.tiny.layers=2", "model.tiny.hidden=64", "model.tiny.heads=2", "algorithm=grpo"]
RUN = ["data.task=reverse", "data.n_train=64", "data.n_eval=9", "eval_size=0", "steps=1", "prompts_per_step=4",
       "samples_per_prompt=2", "max_new_tokens=8", "reward_workers=0", "preflight=false"]  # fmt: skip


@pytest.mark.parametrize("lora", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_the_first_steps_kl_to_the_reference_is_zero_with_gradient_checkpointing(tmp_path, lora):
    overrides = [*TINY, *RUN, *lora, "model.gradient_checkpointing=true", f"output_dir={tmp_path}"]
    history = OnlineRL(load_rl_config(None, overrides), echo=lambda _: None).run()
    assert history[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # was 0.0083 on this model
