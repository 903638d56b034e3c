"""Hub ids as in TRL (issue 23, item 10): ``model.path=org/name`` loads the snapshot in the
Hugging Face cache. Tested offline (HF_HUB_OFFLINE=1) through a cache laid out as
``huggingface_hub`` writes it: models--org--name/{refs/main, snapshots/<commit>/...}."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.cli import main
from posttrain.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding the tiny model ``posttrain-tests/tiny-reverser``."""
    cache = tmp_path / "hub"
    repo = cache / "models--posttrain-tests--tiny-reverser"
    snapshot = repo / "snapshots" / COMMIT
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), layers=1, hidden=32, heads=2, tokenizer=tokenizer, seed=3)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return model


def test_a_hub_id_loads_the_cached_snapshot(hub_cache):
    model = load_causal_lm("posttrain-tests/tiny-reverser")
    tokenizer = load_tokenizer("posttrain-tests/tiny-reverser")
    ids = torch.tensor([tokenizer("sean")["input_ids"]])
    assert torch.equal(model(ids).logits, hub_cache(ids).logits)


def test_a_hub_id_trains_through_the_cli(hub_cache, tmp_path):
    args = ["model.path=posttrain-tests/tiny-reverser", "data.task=reverse", "data.n_train=16", "data.n_eval=9"]
    assert main(["sft", *args, "eval_size=0", "batch_size=4", "steps=1", f"output_dir={tmp_path / 'run'}"]) == 0
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_a_hub_id_missing_from_the_cache_offline_says_where_it_looked(hub_cache):
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ModelLoadError, match="neither in the Hugging Face cache nor downloadable") as error:
            load("posttrain-tests/not-cached")
        assert "hf download posttrain-tests/not-cached" in str(error.value)


def test_a_hub_dataset_id_reads_the_cached_snapshot_by_split(hub_cache, tmp_path):
    import json

    import huggingface_hub.constants

    from posttrain.data import DataError, read_dataset

    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "datasets--posttrain-tests--names"
    (snapshot / "snapshots" / COMMIT).mkdir(parents=True)
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text(COMMIT)
    for split, names in (("train", ["sean", "emma", "liam"]), ("test", ["noah"])):
        rows = [{"prompt": f"Reverse {n}:", "completion": f" {n[::-1]}."} for n in names]
        (snapshot / "snapshots" / COMMIT / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = read_dataset("posttrain-tests/names", split="train")
    assert [row["completion"] for row in train] == [" naes.", " amme.", " mail."]
    assert [row["prompt"] for row in read_dataset("posttrain-tests/names", split="test")] == ["Reverse noah:"]
    with pytest.raises(DataError, match=r"several splits; choose one with data\.split: train, test"):
        read_dataset("posttrain-tests/names")
    with pytest.raises(DataError, match="neither in the Hugging Face cache nor downloadable"):
        read_dataset("posttrain-tests/not-cached")
