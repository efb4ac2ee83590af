"""How pytest-xdist shares the suite among its worker processes (``make test`` runs two).

Each test module goes to one worker whole, so that a module-scoped fixture (a process group of
ranks, a model) is set up once. The modules that use the real servers go to one worker
together, so that the vLLM server and SeaweedFS each start once per run.
"""

from __future__ import annotations

from typing import Any

import pytest

REAL_SERVER_MODULES = (
    "tests/integration/test_vllm_",
    "tests/integration/test_s3_",
    "tests/integration/test_r3_loop.py",
)
"""Path prefixes of the modules whose session fixtures start a real server."""


def worker_scope(nodeid: str) -> str:
    """The unit one worker runs whole: the real servers' modules together, any other module
    alone."""
    module = nodeid.split("::", 1)[0]
    return "real-servers" if module.startswith(REAL_SERVER_MODULES) else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's by-scope scheduler with :func:`worker_scope` as its scopes (its own
    ``loadgroup`` marks do not reach the scheduler under pytest 9.2)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ModuleScheduling(config, log)
