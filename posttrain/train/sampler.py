"""A resumable, seeded order over a dataset's rows."""

from __future__ import annotations

import torch

from posttrain.data.loading import DataError


class EpochSampler:
    """Yields index batches; each epoch is a fresh permutation drawn from ``seed + epoch``.

    The whole state is ``(epoch, position)``, so a resumed run regenerates the exact same
    order from the checkpoint without storing it, whatever else touched the global RNG. The
    short remainder of an epoch is dropped so every batch has ``batch_size`` rows.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int) -> None:
        if num_rows < batch_size:
            # a PosttrainError: rows left out after loading (too long for the context) can get here
            raise DataError(f"{num_rows} usable rows cannot fill one batch of {batch_size}; lower the batch size")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
