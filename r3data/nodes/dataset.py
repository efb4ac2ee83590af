"""``RolloutDataset``: the loader as an ``IterableDataset`` for ``torch.utils.data.DataLoader``
and ``torchdata.stateful_dataloader.StatefulDataLoader``.

Batches are already collated: use ``batch_size=None`` and ``num_workers=0`` (r3data runs
its own threads; worker processes would each yield every batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from r3data.batch import TensorBatch
from r3data.errors import ConfigError
from r3data.nodes.loader import loader


class RolloutDataset(IterableDataset):
    """Yields :class:`TensorBatch`es; ``state_dict``/``load_state_dict`` resume exactly."""

    def __init__(self, samples: Sequence[Any] | Iterable[Any], **loader_options: Any) -> None:
        super().__init__()
        self.loader = loader(samples, **loader_options)

    def __iter__(self) -> Iterator[TensorBatch]:
        info = get_worker_info()
        if info is not None:
            raise ConfigError(
                "RolloutDataset runs its own threads and batches are already collated: use "
                f"DataLoader(..., batch_size=None, num_workers=0), found num_workers={info.num_workers}"
            )
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
