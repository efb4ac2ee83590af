"""An in-memory stand-in for a filesystem that is not local, for the writer's tests."""

from __future__ import annotations

from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem


class MemoryBacked(AbstractFileSystem):
    """Files held in a private ``memory://`` store (``objects``): listings, sizes and deletions
    come from it; a subclass says how a file is opened, and so when a write becomes visible."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.objects = MemoryFileSystem(global_store=False, skip_instance_cache=True)

    def ls(self, path, detail=True, **kwargs):
        return self.objects.ls(path, detail=detail)

    def info(self, path, **kwargs):
        return self.objects.info(path)

    def rm_file(self, path):
        self.objects.rm_file(path)
