"""The training state's data-only format (``run/plain_state.py``): what goes in comes back with
its types, and what could not be read back without running code is refused when saving."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from posttrain.run.plain_state import PlainStateError, load_plain_state, save_plain_state


def test_values_come_back_with_their_types(tmp_path):
    weights = torch.arange(6.0).reshape(2, 3)
    state = {
        "python_rng": random.getstate(),  # a tuple holding a tuple of 625 ints and None
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": weights}, 1: {}}, "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "fused": None, "amsgrad": False}
        ]},
        "view": weights[:, 1],  # shares storage with exp_avg: written as its own tensor
        "transposed": weights.t(),  # not contiguous
        "empty": [torch.empty(0), torch.empty(0)],
        "flags": torch.tensor([True, False]),
        "by_pair": {(1, "a"): "x", None: 2.5, "__tuple__": "a key that looks like a tag"},
        "bounds": [math.inf, -math.inf],
        "numpy_scalar": np.float32(0.5),
    }  # fmt: skip
    save_plain_state(state, tmp_path, "state")
    back = load_plain_state(tmp_path, "state")
    assert back["python_rng"] == state["python_rng"] and isinstance(back["python_rng"][1], tuple)
    assert sorted(back["optimizer"]["state"]) == [0, 1] and back["optimizer"]["state"][1] == {}
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], weights)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["view"], weights[:, 1]) and back["flags"].dtype == torch.bool
    assert torch.equal(back["transposed"], weights.t()) and [t.numel() for t in back["empty"]] == [0, 0]
    assert back["by_pair"] == {(1, "a"): "x", None: 2.5, "__tuple__": "a key that looks like a tag"}
    assert back["bounds"] == [math.inf, -math.inf] and back["numpy_scalar"] == 0.5
    random.setstate(back["python_rng"])


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (np.zeros(3), "numpy.ndarray"),
        ({1, 2}, "builtins.set"),
        (object(), "builtins.object"),
        (lambda: 0, "function"),
    ],
    ids=["array", "set", "object", "function"],
)
def test_what_is_not_data_is_refused_naming_its_place(tmp_path, value, words):
    with pytest.raises(PlainStateError, match=words) as error:
        save_plain_state({"rewards": {"judge": {"cache": [1, value]}}}, tmp_path, "state")
    assert "state/rewards/judge/cache[1]" in str(error.value)


def test_a_damaged_or_inconsistent_file_is_an_error_naming_it(tmp_path):
    save_plain_state({"w": torch.ones(2)}, tmp_path, "state")
    (tmp_path / "state.json").write_text('{"w": {"__tensor__": "t7"}}')
    with pytest.raises(PlainStateError, match="t7"):
        load_plain_state(tmp_path, "state")
    (tmp_path / "state.safetensors").write_bytes(b"junk")
    with pytest.raises(PlainStateError, match=r"state\.safetensors"):
        load_plain_state(tmp_path, "state")
