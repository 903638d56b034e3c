"""Atomic checkpoints: killed saves, corruption, retention, RNG restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer), tokenizer


def test_round_trip_is_a_plain_hf_folder_with_training_state(tmp_path, tiny):
    model, tokenizer = tiny
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    optimizer.step()
    saved = save_checkpoint(
        tmp_path,
        3,
        model=model,
        tokenizer=tokenizer,
        config_yaml="steps: 3\n",
        training_state={"optimizer": optimizer.state_dict(), "data_position": 96},
    )
    after_save = torch.rand(3)
    loaded = AutoModelForCausalLM.from_pretrained(saved.path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    torch.rand(5)  # move the RNG on; loading must put it back
    state = load_training_state(saved.path)
    assert torch.equal(torch.rand(3), after_save)
    assert state["step"] == 3 and state["data_position"] == 96
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    fresh.load_state_dict(state["optimizer"])
    assert (saved.path / "config.yaml").read_text() == "steps: 3\n"


def test_corrupt_and_truncated_files_are_refused_by_name(tmp_path, tiny):
    model, _ = tiny
    older = save_checkpoint(tmp_path, 1, model=model)
    newer = save_checkpoint(tmp_path, 2, model=model)
    weights = newer.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its checksum"):
        verify_checkpoint(newer.path)
    assert latest_checkpoint(tmp_path) == older  # --resume auto falls back to the last good one
    weights.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="truncated"):
        load_training_state(newer.path)
    (older.path / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="interrupted"):
        verify_checkpoint(older.path)
    assert latest_checkpoint(tmp_path) is None


def test_retention_keeps_the_newest(tmp_path, tiny):
    model, _ = tiny
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model=model, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    save_checkpoint(tmp_path, 5, model=model, keep_last=0)  # 0 still keeps the newest
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from posttrain.models.tiny import build_tiny_causal_lm
    from posttrain.run import checkpoint

    model = build_tiny_causal_lm(20, layers=1, hidden=32, heads=2)
    checkpoint.save_checkpoint(sys.argv[1], 1, model=model)

    def stalled_save(*args, **kwargs):  # the model files are written; hang before the rest
        print("writing", flush=True)
        time.sleep(600)

    checkpoint.save_plain_state = stalled_save
    checkpoint.save_checkpoint(sys.argv[1], 2, model=model)
    """
)


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    staging = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".staging")]
    assert staging, "the killed save should have left its staging folder behind"
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1
    # step 1's weights, whole: the killed process built its model with the builder's default seed
    saved = AutoModelForCausalLM.from_pretrained(latest.path).state_dict()
    built = build_tiny_causal_lm(20, layers=1, hidden=32, heads=2).state_dict()
    assert saved.keys() == built.keys() and all(torch.equal(saved[k], built[k]) for k in built)
    load_training_state(latest.path)
    # the next save clears the dead process's staging folder
    save_checkpoint(tmp_path, 3, model=AutoModelForCausalLM.from_pretrained(latest.path))
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".staging")]


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embeddings", "untied"])
def test_a_lora_final_folder_is_the_adapted_model_without_touching_the_policy(tmp_path, tied):
    from posttrain.models.lora import apply_lora
    from posttrain.run.checkpoint import save_final

    tokenizer = build_char_tokenizer()
    base = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=32, heads=2, tokenizer=tokenizer)
    base.config.tie_word_embeddings = tied
    if tied:
        base.tie_weights()
    policy = apply_lora(base, r=4, alpha=8)
    with torch.no_grad():  # trained adapters: B ≠ 0
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    policy.eval()
    ids = torch.tensor([tokenizer("reverse: abc = cba.")["input_ids"]])
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits
        with policy.disable_adapter():
            original = policy(input_ids=ids).logits
    assert (adapted - original).abs().max() > 1e-3  # the adapters matter

    folder = save_final(policy, tmp_path / "final", tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora" in name for name in plain.state_dict())
    assert (folder / "adapter" / "adapter_config.json").is_file() and (folder / "tokenizer.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, atol=1e-5, rtol=0)
        torch.testing.assert_close(policy(input_ids=ids).logits, adapted, atol=0, rtol=0)  # policy as it was
        with policy.disable_adapter():
            torch.testing.assert_close(policy(input_ids=ids).logits, original, atol=0, rtol=0)
