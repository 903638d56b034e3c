"""The ``reward_model`` reward: score completions with a local sequence-classification model —
a reward model trained by ``posttrain rm``, or any classifier, such as a safety model, whose
reward is the probability of one of its labels.

A config entry: ``{name: reward_model, path: runs/rm/final}`` (options: :class:`ModelReward`).

Why it looks like this:

- It stays in the trainer's process (``runs_in_process = True``): the weights are loaded
  once, maybe onto the GPU, and it batches by itself, so sending batches to worker processes
  would only copy data. Rows are sorted by length before batching, so a batch pads little.
- The sequence it scores is, by default, what ``posttrain rm`` trained on: prompt ids +
  completion ids + EOS, each part tokenised on its own (``encode_row`` in ``train/sft.py``),
  and the score is read at the last token of the attention mask (:func:`sequence_scores`). A
  different encoding would give a trained model inputs it never saw.
- Path problems (missing folder, no weights, a causal LM instead of a classifier, an unknown
  label) fail when the config is read, naming the path; the weights load on the first call.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from posttrain.models.chat import chat_prompt_ids, ensure_chat_template
from posttrain.rewards.registry import RewardOutput, register_reward
from posttrain.rewards.rules import completion_text

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# transformers is imported where a model is configured, not here: `import posttrain.rewards`
# stays light for the worker processes that only run rule rewards

Normalize = Literal["none", "running", "batch"]
Encoding = Literal["posttrain", "chat", "text"]
EPS = 1e-6
"""Added to the standard deviation in both normalisations, so a constant batch gives 0s, not NaNs."""


class RunningMeanStd:
    """Mean and variance of every value seen so far, updated a batch at a time with the exact
    parallel formula of Chan, Golub & LeVeque (1979): for the stored (n, μ, M2) and a batch
    (m, μ_b, M2_b), with δ = μ_b − μ: n' = n + m, μ' = μ + δ·m/n', M2' = M2 + M2_b + δ²·n·m/n',
    σ'² = M2'/n' (population variance)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: Tensor) -> None:
        values = values.double()
        m = values.numel()
        if m == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + m
        delta = batch_mean - self.mean
        self.mean += delta * m / total
        self.m2 += batch_m2 + delta**2 * self.count * m / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


@register_reward("reward_model")
class ModelReward:
    """Scores of ``prompt + completion`` under a local ``AutoModelForSequenceClassification`` folder.

    Options (config keys):

    - ``path``: the model folder (``runs/rm/final`` after ``posttrain rm``); ``tokenizer``: its
      tokenizer folder if not the same.
    - ``label``: for a classifier with several labels, which one: an index or a name from its
      config's ``id2label``. The reward is that label's probability: softmax over the labels,
      or sigmoid of its logit when ``config.problem_type`` is ``multi_label_classification``.
      A 1-label model (a reward model) needs no label.
    - ``output``: ``score`` (the raw logit; default for 1-label models) or ``probability``
      (sigmoid for a 1-label model; default for several labels).
    - ``normalize``: ``none``; ``batch``: r' = (r − mean_B(r)) / (std_B(r) + ε) within the batch;
      ``running``: r' = (r − μ) / (σ + ε), with μ, σ the mean and population std of every
      score seen so far, this batch included (:class:`RunningMeanStd`; the first batch is
      normalised by its own statistics). ε = 1e-6. Values are normalised after ``output``.
    - ``encoding``: how a row becomes tokens. ``posttrain`` (default): prompt ids + completion
      ids + EOS, as ``posttrain rm`` trains, and for a conversational prompt the chat
      template's generation prompt + completion + EOS, the tokens a rollout produces. ``chat``:
      the chat template over the conversation with the completion as the assistant's turn
      (Hub reward models). ``text``: ``prompt + completion`` as one text with the tokenizer's
      own special tokens (BERT-style classifiers; a conversational prompt uses ``chat``).
    - ``include_prompt``: false scores the completion alone (classifiers of responses).
    - ``batch_size``: rows per forward pass. ``max_length``: tokens kept per row; longer rows
      lose tokens from the left, i.e. the start of the prompt (the share is logged as
      ``truncated``).
    - ``device`` (``cpu``, ``cuda``, ``cuda:1``, ``auto``), ``dtype`` (``float32``,
      ``bfloat16``, ``float16``, ``auto``), ``trust_remote_code``.
    """

    runs_in_process = True  # see compose.py: weights stay loaded here, batching is done here

    def __init__(
        self,
        path: str | Path,
        label: int | str | None = None,
        output: Literal["score", "probability"] | None = None,
        normalize: Normalize = "none",
        encoding: Encoding = "posttrain",
        include_prompt: bool = True,
        batch_size: int = 32,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        tokenizer: str | Path | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        from posttrain.models.loading import load_tokenizer, resolve_dtype

        self.path = str(path)
        _check_choice("normalize", normalize, ("none", "running", "batch"))
        _check_choice("encoding", encoding, ("posttrain", "chat", "text"))
        _check_choice("output", output, ("score", "probability", None))
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(f"reward_model: batch_size ({batch_size}) and max_length ({max_length}) must be >= 1")
        self.config = _scorer_config(self.path, trust_remote_code)
        self.label_index = resolve_label(self.config, label, self.path)
        self.output = output or ("score" if self.label_index is None else "probability")
        self.normalize, self.encoding, self.include_prompt = normalize, encoding, include_prompt
        self.batch_size, self.max_length = batch_size, max_length
        self.device = _device(device)
        self.dtype = resolve_dtype(dtype)
        self.trust_remote_code = trust_remote_code
        self.tokenizer = load_tokenizer(tokenizer or self.path, trust_remote_code=trust_remote_code)
        self.tokenizer.truncation_side = "left"  # drop the start of the prompt, keep the completion
        if encoding == "posttrain" and self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"reward_model {self.path!r}: the tokenizer has no EOS token, which encoding 'posttrain' ends "
                "each row with; use encoding 'text' (or 'chat')"
            )
        self.running = RunningMeanStd()
        self._model: PreTrainedModel | None = None
        self._lock = threading.Lock()  # one call at a time, also with a call abandoned after a timeout

    @property
    def model(self) -> PreTrainedModel:
        """The classifier, loaded on first use (eval mode, no gradients)."""
        if self._model is None:
            from transformers import AutoModelForSequenceClassification

            from posttrain.models.loading import load_pretrained

            pad = self.config.pad_token_id
            self._model = load_pretrained(
                AutoModelForSequenceClassification,
                self.path,
                dtype=self.dtype,
                device=self.device,
                trust_remote_code=self.trust_remote_code,
                config_updates={"pad_token_id": self.tokenizer.pad_token_id} if pad is None else None,
            )
            self._model.eval().requires_grad_(False)
        return self._model

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any
    ) -> RewardOutput:
        with self._lock:
            encoded = [self.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
            raw = self.rewards_from_logits(self.logits([ids for ids, _ in encoded]))
            values = self._normalized(raw)
        metrics = {
            "raw_mean": float(raw.mean()) if raw.numel() else math.nan,
            "raw_std": float(raw.std(unbiased=False)) if raw.numel() else math.nan,
            "truncated": sum(cut for _, cut in encoded) / max(len(encoded), 1),
        }
        if self.normalize == "running":
            metrics.update(running_mean=self.running.mean, running_std=self.running.std)
        return RewardOutput(values.tolist(), metrics)

    def encode(self, prompt: Any, completion: Any) -> tuple[list[int], bool]:
        """One row → (token ids, whether it was cut to ``max_length``)."""
        tokenizer, text = self.tokenizer, completion_text(completion)
        conversational = not isinstance(prompt, str)
        if self.encoding == "posttrain":
            prompt_ids: list[int] = []
            if self.include_prompt:
                prompt_ids = (
                    chat_prompt_ids(tokenizer, prompt)
                    if conversational
                    else tokenizer(prompt, add_special_tokens=False)["input_ids"]
                )
            ids = [*prompt_ids, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            cut = self.max_length is not None and len(ids) > self.max_length
            return (ids[-self.max_length :] if cut else ids), cut
        if self.encoding == "chat" or conversational:
            messages = []
            if self.include_prompt:
                messages = list(prompt) if conversational else [{"role": "user", "content": prompt}]
            ensure_chat_template(tokenizer)
            whole = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": text}], tokenize=False)
            return self._tokenize(whole, add_special_tokens=False)
        return self._tokenize(prompt + text if self.include_prompt else text, add_special_tokens=True)

    def _tokenize(self, text: str, add_special_tokens: bool) -> tuple[list[int], bool]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if self.max_length is None or len(ids) <= self.max_length:
            return ids, False
        # the tokenizer truncates from the left (set above) and keeps its special tokens
        cut = self.tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=self.max_length)
        return cut["input_ids"], True

    @torch.inference_mode()
    def logits(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """``[B, num_labels]`` float32 logits of the rows, ``batch_size`` rows per forward pass
        after sorting by length; each row's value does not depend on the others."""
        for i, ids in enumerate(sequences):
            if not ids:
                raise ValueError(f"reward_model ({self.path}): row {i} has no tokens to score")
        model = self.model
        device = next(model.parameters()).device
        out = torch.empty(len(sequences), self.config.num_labels)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            ids, mask = _right_pad([sequences[i] for i in rows], self.tokenizer.pad_token_id)
            out[rows] = _forward(model, ids.to(device), mask.to(device)).float().cpu()
        return out

    def rewards_from_logits(self, logits: Tensor) -> Tensor:
        """``[B, num_labels]`` logits → ``[B]`` rewards before normalisation (see ``label``, ``output``)."""
        if self.label_index is None:
            score = logits[:, 0]
            return torch.sigmoid(score) if self.output == "probability" else score
        if self.output == "score":
            return logits[:, self.label_index]
        if self.config.problem_type == "multi_label_classification":
            return torch.sigmoid(logits[:, self.label_index])
        return torch.softmax(logits, dim=-1)[:, self.label_index]

    def _normalized(self, raw: Tensor) -> Tensor:
        if self.normalize == "batch" and raw.numel():
            return (raw - raw.mean()) / (raw.std(unbiased=False) + EPS)
        if self.normalize == "running":
            self.running.update(raw)
            return ((raw.double() - self.running.mean) / (self.running.std + EPS)).float()
        return raw

    def state_dict(self) -> dict[str, Any]:
        """The running normalisation statistics, for a checkpoint."""
        return {"running": self.running.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.running.load_state_dict(state["running"])


def resolve_label(config: Any, label: int | str | None, path: str) -> int | None:
    """The index of ``label`` (an index, or a name from ``config.id2label``), or None for a
    1-label model. Errors list the labels the model has."""
    count = config.num_labels
    names = [str(config.id2label.get(i, i)) for i in range(count)] if config.id2label else []
    listing = ", ".join(f"{i}={n}" for i, n in enumerate(names))
    if count == 1:
        if label is not None:
            raise ValueError(
                f"reward_model {path!r} has one output (a score), so it has no label to choose; drop 'label' "
                "(use 'output: probability' for sigmoid(score))"
            )
        return None
    if label is None:
        raise ValueError(
            f"reward_model {path!r} is a classifier with {count} labels ({listing}); choose one with 'label'"
        )
    if isinstance(label, int) and not isinstance(label, bool):
        if not 0 <= label < count:
            raise ValueError(f"reward_model {path!r}: label {label} is out of range; labels: {listing}")
        return label
    if str(label) in names:
        return names.index(str(label))
    lowered = [n.lower() for n in names]
    if str(label).lower() in lowered:
        return lowered.index(str(label).lower())
    raise ValueError(f"reward_model {path!r} has no label {label!r}; labels: {listing}")


def _scorer_config(path: str, trust_remote_code: bool) -> Any:
    """The folder's config after every check that does not need the weights loaded."""
    from posttrain.models.loading import WEIGHT_SUFFIXES, ModelLoadError, read_config

    try:
        config = read_config(path, trust_remote_code=trust_remote_code)
    except ModelLoadError as error:
        raise ModelLoadError(f"reward_model: {error}") from None
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ModelLoadError(
            f"reward_model: {path} holds {', '.join(architectures) or 'a model of unknown class'}, not a sequence "
            "classifier (its head would be random); give a reward model (`posttrain rm` writes one to "
            "<output_dir>/final) or a classifier folder"
        )
    folder = Path(path).expanduser()
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir()):
        raise ModelLoadError(f"reward_model: {folder} has config.json but no weights (*.safetensors or *.bin)")
    return config


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"reward_model: device {device!r} is not a torch device (cpu, cuda, cuda:1, auto)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"reward_model: device {device!r}, but torch sees no CUDA device; use cpu or auto")
    return device


def _check_choice(option: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices if c is not None)
        raise ValueError(f"reward_model: {option} must be one of {shown}, got {value!r}")


def _right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def _forward(model: PreTrainedModel, ids: Tensor, mask: Tensor) -> Tensor:
    """``[b, num_labels]``. Decoder classifiers (a ``score`` head on a causal body) read the
    last token of the mask (:func:`sequence_scores`: right whatever the pad id); others (BERT-
    style encoders) pool as their own forward does."""
    from posttrain.models.reward import sequence_scores

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "score") and hasattr(inner, inner.base_model_prefix):
        return sequence_scores(model, ids, mask).reshape(len(ids), -1)
    return model(input_ids=ids, attention_mask=mask).logits
