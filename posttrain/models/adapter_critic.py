"""A light critic: the policy's frozen base, the critic's own LoRA adapters and a scalar head.

With ``model.lora`` the policy is a frozen base plus adapters; a full critic beside it would hold a
second copy of the body with its gradients and AdamW moments — four times the base's size. This
critic shares the base instead (the "light critic" of issue 42; cf. the shared-backbone value heads
of PPO for LLMs): its forward runs the policy's transformer with the *policy's* adapters switched
off and the critic's own adapters added on the same projections, then reads
``V(s_t) = w·h_t + b`` from the final hidden state ``h_t``:

    W_critic = W_base + (α/r)·B_c·A_c   on every projection the policy adapts (B_c = 0 at the start)

so its trained state is the adapters and the head alone (``parameters()``, ``state_dict()``, its
optimizer and its checkpoint hold nothing else); the policy is referenced, not a submodule. The
adapters act through forward hooks on the base layers, installed only while the critic runs
(:meth:`AdapterCritic.in_use`), so the policy's own passes never see them; a pass that recomputes
its layers in backward (gradient checkpointing) must run its backward inside that block too
(``critic_pass``). Under ``strategy: fsdp2`` the policy's base is sharded and its forward gathers
it; the critic's own parameters stay whole on every rank (``replicated``), their gradients summed.
Its values start at 0 (zero head), like the full critic's (``models/value.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class CriticOutput:
    logits: Tensor  # [B, L, 1]: one value per position, as a token classifier's output


class AdapterCritic(nn.Module):
    """V(s_t) from the shared base of a LoRA ``policy`` (peft) with the critic's own adapters of
    rank ``r`` and scale ``alpha / r`` on each projection the policy adapts, and a zero head."""

    replicated = True  # tiny: whole on every rank under fsdp2 (distributed.py), gradients summed

    def __init__(self, policy: nn.Module, *, r: int, alpha: int) -> None:
        super().__init__()
        from peft.tuners.lora import Linear as LoraLinear

        object.__setattr__(self, "policy", policy)  # referenced, not registered: not in parameters()
        targets = {name: m.get_base_layer() for name, m in policy.named_modules() if isinstance(m, LoraLinear)}
        if not targets:
            raise TypeError("AdapterCritic needs a LoRA (peft) policy with adapted linear layers")
        weight = next(iter(targets.values())).weight
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.targets = list(targets.values())
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for layer in self.targets:
            a = torch.empty(r, layer.in_features, **factory)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's default init of A; B = 0
            self.lora_A.append(nn.Parameter(a))
            self.lora_B.append(nn.Parameter(torch.zeros(layer.out_features, r, **factory)))
        self.scaling = alpha / r
        hidden = policy.get_base_model().config.hidden_size
        self.score = nn.Linear(hidden, 1, **factory)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.zero_()
        self._depth, self._stack = 0, contextlib.ExitStack()  # the hooks while in use

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """The policy computes the critic's base while inside: its adapters off, the critic's on.
        Re-entrant; the hooks go when the outermost block ends."""
        if self._depth == 0:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(self.policy.disable_adapter())
            for index, layer in enumerate(self.targets):
                hook = layer.register_forward_hook(self._hook(index))
                self._stack.callback(hook.remove)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._stack.close()

    def _hook(self, index: int) -> Any:
        def add_delta(_layer: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            a, b = self.lora_A[index], self.lora_B[index]
            return output + self.scaling * nn.functional.linear(nn.functional.linear(inputs[0].to(a.dtype), a), b)

        return add_delta

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> CriticOutput:
        # the body's final hidden states, taken as it returns them: the whole model's forward is what
        # gathers a sharded model's embeddings (output_hidden_states misses FSDP2's wrapped layers)
        base = self.policy.get_base_model()
        body, hidden = getattr(base, base.base_model_prefix), []
        handle = body.register_forward_hook(lambda _module, _inputs, out: hidden.append(out.last_hidden_state))
        try:
            with self.in_use():
                self.policy(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=1,  # the policy's output layer on one position only: unused here
                )
        finally:
            handle.remove()
        return CriticOutput(logits=self.score(hidden[0].to(self.score.weight.dtype)))


def critic_pass(critic: nn.Module) -> contextlib.AbstractContextManager:
    """The block a critic's forward and backward run in: an :class:`AdapterCritic`'s
    :meth:`~AdapterCritic.in_use` (so recomputed layers see its adapters), else nothing."""
    return critic.in_use() if isinstance(critic, AdapterCritic) else contextlib.nullcontext()
