"""``RolloutDataset``: the loader as an ``IterableDataset`` for ``torch.utils.data.DataLoader``
and ``torchdata.stateful_dataloader.StatefulDataLoader``.

Batches are already collated micro-batches of one rank: use ``batch_size=None`` and
``num_workers=0`` (r3data runs its own threads; worker processes would each read every sample
and copy every batch across a process boundary), and give the data-parallel rank to the loader
(``data_parallel=``), not a ``DistributedSampler``. Each of these mistakes is refused with one
line that says what to write instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from r3data.batch import TensorBatch
from r3data.errors import UsageError
from r3data.nodes.loader import loader

__all__ = ["RolloutDataset", "WorkersRefused"]

_WORKER_TRACEBACK = "\nOriginal Traceback (most recent call last)"


class WorkersRefused(UsageError):
    """``DataLoader(num_workers > 0)``: refused in the worker; torch re-raises it in the
    trainer's process as ``WorkersRefused(<its own banner and the worker's traceback>)``, which
    keeps the one line that says why (the traceback stays readable as a note)."""

    def __init__(self, message: str) -> None:
        if _WORKER_TRACEBACK in message:
            traceback = message.split("\n", 1)[1]
            message = traceback.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]
            super().__init__(message)
            self.add_note(traceback)
        else:
            super().__init__(message)


def _refuse_collation(batch: Any, *, collate_fn_map: Any = None) -> None:
    raise UsageError(
        "RolloutDataset yields collated micro-batches (TensorBatch): pass "
        f"DataLoader(..., batch_size=None), found batch_size={len(batch)}"
    )


# torch's documented hook: default_collate looks types up in this registry
default_collate_fn_map[TensorBatch] = _refuse_collation


class RolloutDataset(IterableDataset):
    """Yields :class:`TensorBatch`es; ``state_dict``/``load_state_dict`` resume exactly."""

    def __init__(self, samples: Sequence[Any] | Iterable[Any], **loader_options: Any) -> None:
        super().__init__()
        self.loader = loader(samples, **loader_options)

    def __iter__(self) -> Iterator[TensorBatch]:
        info = get_worker_info()
        if info is not None:
            raise WorkersRefused(
                "RolloutDataset runs its own threads and yields collated micro-batches: pass "
                f"DataLoader(..., batch_size=None, num_workers=0), found "
                f"num_workers={info.num_workers}"
            )
        return iter(self.loader)

    def __len__(self) -> int:
        raise UsageError(
            "RolloutDataset is a stream of micro-batches that already shards data-parallel "
            "ranks: give loader(..., data_parallel=DataParallel(rank=..., size=...)) (or "
            "DataParallel.from_torch()) instead of a DistributedSampler"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
