"""``BatchSteps``: the training step each sample's batch is trained at.

Samples arrive in order and batches are cut every ``batch_size`` samples, so sample ``i``
(counted from the start of the data, also after a resume) is in batch ``i // batch_size``,
trained at step ``start_step + i // batch_size``. Retention claims use it before the batch
even exists, and each batch records it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSteps:
    batch_size: int
    start_step: int = 0

    def __call__(self, index: int) -> int:
        return self.start_step + index // self.batch_size
