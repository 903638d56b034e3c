"""Generation for a sharded policy (``strategy: fsdp2`` under torchrun).

Each rank of an RL run generates its own prompts, to lengths of their own; a sharded model
gathers its weights in every forward pass, a collective every rank must join, so it cannot
decode on one rank alone. :class:`GatheredEngine` decodes with a whole copy of the policy
instead (made before sharding): after every update each rank gathers the policy's whole weights
(every rank takes part, at the same point of the loop: ``sync_weights``) and loads them into its
copy, as verl hands an FSDP actor's weights to its inference engine. The engine over the copy is
any engine: a local one, or the rank's Ray rollout workers, which take the copy's weights as they
would take an unsharded policy's. The copy costs one whole model per rank; training state stays
sharded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from posttrain.distributed import world
from posttrain.rollout.types import Rollouts, SamplingParams


class GatheredEngine:
    """``engine``, an engine over ``whole`` (a copy of ``policy`` made before sharding), with the
    sharded ``policy``'s gathered weights loaded into ``whole`` at every ``update_weights``."""

    def __init__(self, policy: nn.Module, whole: nn.Module, engine: Any) -> None:
        self.policy, self.whole_model = policy, whole  # the copy also evaluates (train/rl_sources.py)
        self.engine = engine
        self.pad_id, self.eos_id = engine.pad_id, engine.eos_id

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        return self.engine.generate(prompts, sampling)

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Gather the policy's whole weights (a collective: every rank calls this) into the copy, then
        refresh the engine over it as a colocated engine is refreshed (Ray workers: sent the copy's)."""
        weights = world().full_weights(self.policy, everywhere=True) if state_dict is None else state_dict
        self.whole_model.load_state_dict(weights)
        self.engine.update_weights(version)

    def catch_up(self, version: int) -> None:
        """:meth:`update_weights` unless the copy holds ``version`` already: before an evaluation
        of a run whose source does not keep this engine current (an asynchronous producer samples
        with its own copy; a replay samples nothing). A collective: every rank calls it."""
        if version != self.policy_version:
            self.update_weights(version)

    def close(self) -> None:
        """Stop the engine's workers, if it has any (Ray rollout workers)."""
        if hasattr(self.engine, "close"):
            self.engine.close()
