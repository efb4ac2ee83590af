"""``ClaimFiles``: the root node that hands each batch's payload files to retention.

It runs when the trainer takes the batch (after any prefetching), so a file is claimed only
once its batch has shipped; the trainer then only calls ``retention.on_policy_update(step)``.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from r3data.batch import TensorBatch
from r3data.payload.retention import PayloadRetention


class ClaimFiles(BaseNode[TensorBatch]):
    """Claims batch k's files at step ``start_step + k``; files of dropped samples are discarded.

    Each batch's ``metadata["step"]`` says the step it was claimed for.
    """

    SOURCE_KEY = "source"
    STEP_KEY = "step"

    def __init__(
        self, source: BaseNode[TensorBatch], retention: PayloadRetention, start_step: int = 0
    ) -> None:
        super().__init__()
        self.source = source
        self.retention = retention
        self.start_step = start_step
        self._step = start_step

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset()
            self._step = self.start_step
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._step = initial_state[self.STEP_KEY]

    def next(self) -> TensorBatch:
        batch = next(self.source)
        self.retention.claim(self._step, batch.metadata.get("files", ()))
        if batch.metadata.get("dropped_files"):
            self.retention.discard(batch.metadata["dropped_files"])
        batch.metadata["step"] = self._step
        self._step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.STEP_KEY: self._step}
