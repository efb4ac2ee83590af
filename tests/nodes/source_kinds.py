"""The kinds of sample source ``r3data.loader`` reads, for tests that run each one."""

from __future__ import annotations

from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader


class Again:
    """A re-iterable that is not map-style (no len, no indexing): a stream, fast-forwarded on
    resume."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


SOURCES = {
    "list": lambda samples: samples,
    "re-iterable": Again,
    "node": IterableWrapper,
    "stateful": lambda samples: StatefulDataLoader(
        samples, batch_size=None, collate_fn=lambda sample: sample
    ),
}
