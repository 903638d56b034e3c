"""SFT packing (issue 23, item 10): examples packed into one row see nothing of each other, so
their log-probs and the loss equal those of the unpacked examples; `posttrain sft packing=true`
trains with less padding, refuses an example longer than max_length naming its row, and resumes
exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from posttrain.data.tasks.reverse import make_rows
from posttrain.models.logprobs import token_logprobs
from posttrain.models.packing import packed_token_logprobs
from posttrain.models.tiny import build_tiny_causal_lm
from posttrain.models.tokenizers import build_char_tokenizer
from posttrain.train.packing import pack_examples, packed_examples
from posttrain.train.sft import SFTObjective, encode_row

NAMES = ["sean", "akshita", "bo", "marguerite", "li", "ann"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def examples_of(tokenizer, names=NAMES):
    return [encode_row(tokenizer, r["prompt"], r["completion"]) for r in make_rows(names)]


def alone_logprobs(model, examples):
    """Per-token log-probs of each example run by itself (no padding, positions from 0)."""
    out = []
    for ids, _ in examples:
        ids_t = torch.tensor([ids])
        out.append(token_logprobs(model(ids_t).logits[:, :-1], ids_t[:, 1:])[0])
    return out


def packed_logprobs(model, packs):
    """Each example's per-token log-probs from one padding-free pass over every pack, end to end
    (scoring every token after an example's first, whatever its loss mask)."""
    full = [tuple((ids, [1] * len(ids)) for ids, _ in pack) for pack in packs]
    logprobs, _ = packed_token_logprobs(model, packed_examples(full))
    sizes = [len(ids) - 1 for pack in packs for ids, _ in pack]
    return list(logprobs.split(sizes))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_examples_have_the_log_probs_and_loss_of_the_unpacked_ones(tokenizer, arch):
    model = build_tiny_causal_lm(len(tokenizer), arch=arch, layers=2, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    examples = examples_of(tokenizer)
    longest = max(len(ids) for ids, _ in examples)
    packs = pack_examples(examples, max_length=2 * longest + 5, seed=0)
    assert len(packs) < len(examples) and max(len(p) for p in packs) >= 2  # rows really hold several examples
    flat = [example for pack in packs for example in pack]
    with torch.no_grad():
        alone = alone_logprobs(model, flat)
        packed = packed_logprobs(model, packs)
        for a, p in zip(alone, packed, strict=True):
            torch.testing.assert_close(p, a, atol=1e-5, rtol=1e-5)
        # the loss as the loop computes it, normalised per completion token either way
        packed_objective, plain_objective = SFTObjective(model, tokenizer, packing=True), SFTObjective(model, tokenizer)
        packed_loss, _ = packed_objective.loss(packs, packed_objective.units(packs))
        plain_loss, _ = plain_objective.loss(flat, plain_objective.units(flat))
    assert packed_objective.units(packs) == plain_objective.units(flat)
    assert packed_loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)


def test_a_row_whose_examples_see_each_other_changes_the_log_probs(tokenizer):
    """The comparison above can fail: with the whole row one document, the second example
    attends to the first and its log-probs move."""
    model = build_tiny_causal_lm(len(tokenizer), layers=2, hidden=32, heads=2, seed=0, tokenizer=tokenizer)
    examples = examples_of(tokenizer, NAMES[:2])
    with torch.no_grad():
        alone = alone_logprobs(model, examples)
        right = packed_logprobs(model, [tuple(examples)])
        row = packed_examples([tuple((ids, [1] * len(ids)) for ids, _ in examples)])
        width = row.input_ids.shape[1]
        leaky = dataclasses.replace(row, offsets=torch.tensor([0, width]), bounds=((0, width),))
        wrong, _ = packed_token_logprobs(model, leaky)
    torch.testing.assert_close(right[1], alone[1], atol=1e-5, rtol=1e-5)
    assert (wrong[len(examples[0][0]) - 1 :] - alone[1]).abs().max() > 1e-3


def test_the_row_restarts_positions_and_scores_no_example_s_first_token():
    row = packed_examples([(([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1])), (([4], [1]),)])
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 4]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert row.bounds == ((0, 3), (3, 5), (5, 6))
    assert row.predictors.tolist() == [0, 1, 3] and row.targets.tolist() == [6, 7, 9]


def test_first_fit_fills_rows_in_a_seeded_order():
    examples = [([1] * n, [1] * n) for n in (6, 5, 4, 3, 2, 1)]
    packs = pack_examples(examples, max_length=7, seed=0)
    assert all(sum(len(ids) for ids, _ in pack) <= 7 for pack in packs)
    assert sorted(len(ids) for pack in packs for ids, _ in pack) == [1, 2, 3, 4, 5, 6]
    assert packs == pack_examples(examples, max_length=7, seed=0)
    # first-fit: an example opened or joined row j only because it fit in no earlier row, whose
    # room has only shrunk since
    room = [7 - sum(len(ids) for ids, _ in pack) for pack in packs]
    for j, pack in enumerate(packs):
        assert all(len(ids) > room[i] for ids, _ in pack for i in range(j)), packs
    assert len(packs) == 4


TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2", "log_every=100", "eval_size=0"]


def write_names(path, names):
    path.write_text("".join(json.dumps(row) + "\n" for row in make_rows(names)), encoding="utf-8")
    return path


def sft_records(folder):
    from posttrain.telemetry.metrics import read_jsonl

    return [r for r in read_jsonl(folder / "metrics.jsonl") if "lr" in r]


@pytest.mark.slow
def test_sft_with_packing_from_the_command_line_trains_with_less_padding(tmp_path):
    from posttrain.cli import main

    common = [*TINY, "data.task=reverse", "data.n_train=64", "data.n_eval=9", "steps=3", "batch_size=4"]
    assert main(["sft", *common, "packing=true", "max_length=128", f"output_dir={tmp_path / 'packed'}"]) == 0
    assert main(["sft", *common, f"output_dir={tmp_path / 'plain'}"]) == 0
    packed, plain = sft_records(tmp_path / "packed"), sft_records(tmp_path / "plain")
    assert [r["step"] for r in packed] == [1, 2, 3]
    assert all(r["loss/sft"] > 0 for r in packed)  # a real NLL of random weights over ~60 characters
    packed_padding = sum(r["train/padding_fraction"] for r in packed) / 3
    plain_padding = sum(r["train/padding_fraction"] for r in plain) / 3
    assert packed_padding < plain_padding


@pytest.mark.parametrize("packing", ["true", "false"])
def test_an_example_longer_than_max_length_is_refused_naming_its_row(tmp_path, capsys, packing):
    from posttrain.cli import main

    data = write_names(tmp_path / "rows.jsonl", ["bo", "maximiliano-alessandro", "li", "ann"])
    capsys.readouterr()
    argv = ["sft", *TINY, f"data.path={data}", f"packing={packing}", "max_length=40", "batch_size=1"]
    assert main([*argv, f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(data) in err
    assert "1 of 4 rows" in err and "longer than max_length of 40 tokens" in err and "(rows 1;" in err, err
    assert "raise max_length" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_too_few_packed_rows_for_a_batch_are_refused(tmp_path, capsys):
    from posttrain.cli import main

    data = write_names(tmp_path / "rows.jsonl", ["bo", "li", "ann", "sean"])
    capsys.readouterr()
    argv = ["sft", *TINY, f"data.path={data}", "packing=true", "max_length=200", "batch_size=2"]
    assert main([*argv, f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "makes 1 packed rows, fewer than batch_size=2" in err, err


@pytest.mark.slow
def test_a_packed_sft_run_resumes_exactly(tmp_path):
    from posttrain.cli import main
    from posttrain.run.checkpoint import checkpoint_root

    common = [*TINY, "data.task=reverse", "data.n_train=40", "data.n_eval=9", "packing=true", "max_length=100"]
    common += ["batch_size=2", "steps=6", "save_every=2", "keep_last=6", "learning_rate=1e-2"]
    assert main(["sft", *common, f"output_dir={tmp_path / 'straight'}"]) == 0
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "final")
    for step in (4, 6):
        shutil.rmtree(checkpoint_root(tmp_path / "resumed") / f"step-{step}")
    assert main(["sft", *common, f"output_dir={tmp_path / 'resumed'}", "--resume", "auto"]) == 0

    def records(name):
        return [
            {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in sft_records(tmp_path / name)
        ]

    assert [r["step"] for r in records("resumed")] == list(range(1, 7))
    assert records("resumed") == records("straight")
