"""Recorded batches: ``record_rollouts: true`` writes every step's scored batch under the run's
``rollouts/``; ``rollout.replay: <that folder>`` feeds them back through the unchanged update.

Generation and the update can then be debugged apart: a replayed run trains on exactly the
batches the recorded one sampled, so (from the same starting weights and config) its losses
and gradient norms repeat those of the recording to the bit, with no engine and no reward
function called. Each step is two files, written whole or not at all (a killed run leaves no
half file; its resume writes the steps again):

* ``step-000001.safetensors`` — the batch's tensors (token ids, masks, engine log-probs,
  group ids, scores, reward components, the greedy baseline and the sampling masks where there are);
* ``step-000001.json`` — the schema version, the step, the prompts, completions and dataset
  columns, the source's metrics of that step, and what gives the batch its shape and meaning
  (``run``: prompts_per_step, samples_per_prompt, the model that sampled it).

A folder recorded under another schema version is refused with both versions named; so is a
replay whose prompts_per_step, samples_per_prompt or model differ from the recording's (another
loss or estimator is allowed: an A/B on the same batches), and one that holds every N-th step
only (``record_rollouts: auto`` on a long run records for viewing, not for replay).

For ``posttrain view`` the loop also writes what batch preparation added to a recorded step
(``step-000001.prepared.safetensors``: advantages, the loss mask, the trainer's π_old log-probs
where computed, with the group ids and tokens that tie each row to its recorded sample); replay
never reads it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from posttrain.distributed import world
from posttrain.errors import PosttrainError
from posttrain.rollout.batch import RolloutBatch, concat
from posttrain.sources import RolloutSource
from posttrain.sources.wrapper import SourceWrapper

# 2: the run's shape and model ("run"), checked on replay; 3: engine_logprobs are the behaviour
# distribution's (renormalised over top-k/top-p/min-p's kept tokens), sampling_mask may be present
SCHEMA_VERSION = 3
TEXT_FIELDS = ("prompts", "completions", "columns")
PREPARED_TENSORS = ("group_ids", "response_ids", "response_mask", "advantages", "loss_mask", "old_logprobs")
REQUIRED_TENSORS = tuple(
    item.name for item in dataclasses.fields(RolloutBatch) if item.default is dataclasses.MISSING
    and item.default_factory is dataclasses.MISSING and item.name not in TEXT_FIELDS
)  # fmt: skip


class RecordingError(PosttrainError, ValueError):
    """A recorded-rollouts folder that cannot be replayed; the message says which file and why."""


def _stem(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}"


def run_shape(config: Any) -> dict[str, Any]:
    """What a recording must share with the run that replays it (an ``RLRun``)."""
    model = config.model
    return {
        "prompts_per_step": config.prompts_per_step,
        "samples_per_prompt": config.samples_per_prompt,
        "model": {"path": model.path, "tiny": model.tiny.model_dump() if model.tiny is not None else None},
    }


def write_batch(
    folder: Path, step: int, batch: RolloutBatch, metrics: dict[str, float], run: dict[str, Any] | None = None
) -> None:
    """Write ``batch`` (as a source hands it out: scored, not yet prepared) for ``step``; ``run``:
    :func:`run_shape` of the recording run."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = _stem(folder, step)
    tensors = {
        item.name: value.detach().cpu().contiguous()
        for item in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, item.name), Tensor)
    }
    text = {
        "schema_version": SCHEMA_VERSION,
        "step": step,
        **{name: getattr(batch, name) for name in TEXT_FIELDS},
        "metrics": metrics,
        "run": run,
    }
    # the tensors first, each file through a temporary name: the JSON's presence marks a whole step
    for path, write in (
        (stem.with_suffix(".safetensors"), lambda tmp: save_file(tensors, str(tmp))),
        (stem.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(text, default=str), encoding="utf-8")),
    ):
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        os.replace(tmp, path)


def read_batch(folder: Path, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch and metrics recorded for ``step``; a missing step or another schema is refused."""
    stem = _stem(folder, step)
    text_path, tensor_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    if not text_path.is_file() or not tensor_path.is_file():
        recorded = recorded_steps(folder)
        held = f"steps {recorded[0]}–{recorded[-1]}" if recorded else "no step"
        raise RecordingError(
            f"{folder} holds no recorded batch for step {step} ({held}); replay at most as many steps as were "
            "recorded (set steps), or record a longer run with record_rollouts: true"
        )
    try:
        text = json.loads(text_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordingError(f"{text_path} is not a readable recording ({error})") from None
    version = text.get("schema_version") if isinstance(text, dict) else None
    if version != SCHEMA_VERSION:
        raise RecordingError(
            f"{text_path} was recorded with schema version {version!r}; this posttrain reads version "
            f"{SCHEMA_VERSION}: record the run again with this version"
        )
    try:
        tensors = load_file(str(tensor_path))
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise RecordingError(f"{tensor_path} is not a readable recording ({error})") from None
    _check_fields(text, tensors, text_path, tensor_path)
    batch = RolloutBatch(**tensors, **{name: text[name] for name in TEXT_FIELDS})
    return batch, dict(text.get("metrics") or {})


def write_prepared(folder: Path, step: int, batch: RolloutBatch) -> None:
    """What preparation added to ``step``'s batch (:data:`PREPARED_TENSORS` it holds), beside its recording."""
    tensors = {
        name: value.detach().cpu().contiguous()
        for name in PREPARED_TENSORS
        if isinstance(value := getattr(batch, name), Tensor)
    }
    path = _stem(folder, step).with_suffix(".prepared.safetensors")
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def read_prepared(folder: Path, step: int) -> dict[str, Tensor] | None:
    """The tensors :func:`write_prepared` wrote for ``step``, or None (not written, or unreadable)."""
    path = _stem(folder, step).with_suffix(".prepared.safetensors")
    try:
        return load_file(str(path)) if path.is_file() else None
    except Exception:  # a damaged annotation only costs the view its advantages
        return None


def _check_fields(text: dict[str, Any], tensors: dict[str, Tensor], text_path: Path, tensor_path: Path) -> None:
    """Every field a batch needs, of one batch size B (and one response length T)."""
    names = {item.name for item in dataclasses.fields(RolloutBatch)}
    unknown = sorted(set(tensors) - names)
    if unknown:
        raise RecordingError(f"{tensor_path} holds tensors this posttrain has no field for: {unknown}")
    missing = [name for name in REQUIRED_TENSORS if name not in tensors]
    if missing:
        raise RecordingError(f"{tensor_path} lacks the tensors {missing} every recorded batch holds (damaged?)")
    kinds = {"prompts": list, "completions": list, "columns": dict}
    wrong = [name for name, kind in kinds.items() if not isinstance(text.get(name), kind)]
    if wrong:
        raise RecordingError(f"{text_path} lacks {wrong} (or holds another type) that every recorded batch holds")
    size = len(text["prompts"])
    for name, value in [*tensors.items(), ("completions", text["completions"]), *text["columns"].items()]:
        rows = len(value) if isinstance(value, list) or (isinstance(value, Tensor) and value.dim()) else -1
        if rows != size:
            raise RecordingError(f"{text_path}: {name} holds {rows} samples, prompts {size}; the step is damaged")
    widths = {name: tensors[name].shape for name in ("response_ids", "response_mask", "engine_logprobs")}
    if len(set(widths.values())) != 1:
        raise RecordingError(f"{tensor_path}: the response tensors differ in shape ({widths})")


def check_replay_run(folder: Path, run: dict[str, Any]) -> None:
    """Refuse replaying ``folder`` in a run whose shape or model (:func:`run_shape`) differs."""
    text_path = _stem(folder, recorded_steps(folder)[0]).with_suffix(".json")
    recorded = json.loads(text_path.read_text(encoding="utf-8")).get("run")
    if not isinstance(recorded, dict):  # written by a caller of write_batch that did not say (the API)
        return
    changed = [key for key in run if recorded.get(key) != run[key]]
    if changed:
        differences = "; ".join(f"{key}: recorded {recorded.get(key)!r}, here {run[key]!r}" for key in changed)
        raise RecordingError(
            f"rollout.replay = {str(folder)!r} was recorded by another kind of run ({differences}). A recording "
            "replays with the shape and model that sampled it; set these as recorded (another loss or advantage "
            "estimator is fine)."
        )


def recorded_steps(folder: Path) -> list[int]:
    """The steps with a complete recording in ``folder``, ascending."""
    steps = []
    for path in folder.glob("step-*.json"):
        if path.stem[5:].isdigit() and path.with_suffix(".safetensors").is_file():
            steps.append(int(path.stem[5:]))
    return sorted(steps)


def check_replay_folder(
    folder: str | Path, steps: int, run: dict[str, Any] | None = None, *, sampling_masks: bool = False
) -> Path:
    """Refuse, before any model loads, a replay folder that is missing, too short for ``steps``,
    recorded by a run of another shape or model than ``run`` (:func:`run_shape`), or, when the run
    renormalises over the sampler's kept sets (``sampling_masks``), recorded without them."""
    path = Path(folder)
    if not path.is_dir():
        raise RecordingError(
            f"rollout.replay = {str(folder)!r} is not a folder; point it at the rollouts/ folder of a run "
            "recorded with record_rollouts: true"
        )
    recorded = recorded_steps(path)
    missing = sorted(set(range(1, steps + 1)) - set(recorded))
    if missing and len(recorded) > 1 and recorded[1] - recorded[0] > 1:
        raise RecordingError(
            f"rollout.replay = {str(folder)!r} holds one step in {recorded[1] - recorded[0]} only (record_rollouts: "
            "auto records a long run for viewing); a replay needs every step: record with record_rollouts: true"
        )
    if missing:
        held = f"steps {recorded[0]}–{recorded[-1]}" if recorded else "no recorded step"
        raise RecordingError(
            f"rollout.replay = {str(folder)!r} holds {held}, not step {missing[0]} of the {steps} asked for: "
            "lower steps or record a longer run"
        )
    first, _ = read_batch(path, 1)  # the schema version and the fields, before anything loads
    if sampling_masks and first.sampling_mask is None:
        raise RecordingError(
            f"rollout.replay = {str(folder)!r} was recorded without the sampler's kept sets, which "
            "rollout.keep_sampling_mask renormalises over (without them it would train unrenormalised): record "
            "with rollout.keep_sampling_mask: true, or replay with it false"
        )
    if run is not None:
        check_replay_run(path, run)
    return path


class RecordingSource(SourceWrapper):
    """Wraps a source and writes every batch it hands out to ``folder`` (``record_rollouts``).

    Under torchrun the ranks' shares are recorded as the step's one batch, by rank 0: a
    recording replays alike in one process or several. ``every``: only steps 1, 1 + every, …
    are written (a long run's recording for viewing)."""

    def __init__(self, inner: RolloutSource, folder: Path, run: dict[str, Any] | None = None, every: int = 1) -> None:
        super().__init__(inner)  # the rest of the protocol is the inner source's
        self.folder, self.ranks, self.run, self.every = Path(folder), world(), run, every

    def records(self, step: int) -> bool:
        return (step - 1) % self.every == 0

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = self.inner.next_batch(step)
        if self.records(step):
            whole = concat(self.ranks.gather(batch), pad_id=0)  # a pad under mask 0 is never read
            step_metrics = self.ranks.reduce_metrics(metrics)
            if self.ranks.is_main:
                write_batch(self.folder, step, whole, step_metrics, self.run)
        return batch, metrics

    def annotate(self, step: int, prepared: RolloutBatch) -> None:
        """Write what preparation added to a recorded step (``prepared``: the step's whole batch)."""
        if self.records(step) and self.ranks.is_main:
            write_prepared(self.folder, step, prepared)


class ReplaySource:
    """The batches of a recorded run, step by step (``rollout.replay``): no engine, no reward.
    Under torchrun each rank replays its share of each batch's groups (distributed.py)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder, self.ranks = Path(folder), world()

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics = read_batch(self.folder, step)
        mine = torch.tensor(self.ranks.split(batch.group_ids.unique().tolist()), dtype=torch.long)
        return batch.select(torch.nonzero(torch.isin(batch.group_ids, mine)).flatten()), metrics

    def sync_weights(self, version: int) -> None:
        pass  # the batches were sampled already

    def state_dict(self) -> dict[str, Any]:
        return {}  # the step number says where to continue

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        return []

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
