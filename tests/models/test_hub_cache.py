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


@pytest.mark.parametrize("name", ["posttrain-tests/tiny-reverser", "hub:posttrain-tests/tiny-reverser"])
def test_a_hub_id_trains_through_the_cli(hub_cache, tmp_path, name):
    args = [f"model.path={name}", "data.task=reverse", "data.n_train=16", "data.n_eval=9"]
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


@pytest.fixture
def hub_calls(monkeypatch) -> list[tuple[str, str]]:
    """The Hub client stubbed: records every repository asked for, and answers 'not found'."""
    import huggingface_hub

    calls: list[tuple[str, str]] = []

    def snapshot_download(repo_id, repo_type="model", **_):
        calls.append((repo_id, repo_type))
        raise FileNotFoundError(f"stub: {repo_id} is not on this Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


LOCAL_LOOKING = ["runs/final", "./x", "~/x", "sft_final", "data.jsonl", "runs/sft.json", "/abs/org/name"]


@pytest.mark.parametrize("path", LOCAL_LOOKING)
def test_a_missing_local_path_never_reaches_the_hub(hub_calls, tmp_path, monkeypatch, path):
    """Issue 45, item 6: a typo is not a download."""
    from posttrain.data import DataError, read_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # `runs/final` while runs/ exists: a local folder mistyped
    with pytest.raises(ModelLoadError, match="does not exist") as error:
        load_causal_lm(path)
    assert "Hub" not in str(error.value)
    with pytest.raises(DataError, match="does not exist"):
        read_dataset(path)
    assert hub_calls == []


def test_hub_prefix_always_reaches_the_hub_and_a_bare_id_says_so_first(hub_calls, tmp_path, monkeypatch, capsys):
    from posttrain.data import DataError, read_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelLoadError, match="hf download runs/final"):
        load_causal_lm("hub:runs/final")  # the prefix wins over a local folder of that name
    assert hub_calls == [("runs/final", "model")] and "[hub]" not in capsys.readouterr().err
    with pytest.raises(DataError, match="neither in the Hugging Face cache"):
        read_dataset("someorg/names")
    assert hub_calls[-1] == ("someorg/names", "dataset")
    assert "[hub] 'someorg/names' is not a local path" in capsys.readouterr().err
    with pytest.raises(ModelLoadError):
        load_causal_lm("hub:gpt2")
    assert hub_calls[-1] == ("gpt2", "model")
