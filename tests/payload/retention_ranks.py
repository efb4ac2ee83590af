"""What each rank of the spawned retention groups does (a module, so spawned ranks import it)."""

from __future__ import annotations

import os

import torch.distributed as dist

from r3data.payload import PayloadRetention


def mixed_claims(rank: int, world: int, store: str, root: str, files: list[str]) -> dict:
    """Rank 1 streams (claims ``streamed`` and ``shared`` for the sweep) and consumes
    ``consumed``; rank 0 consumes ``shared`` too. Reports what is left after each update."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        streamed, consumed, shared = files
        retention = PayloadRetention(root, 1, fresh=False, group=dist.group.WORLD)
        if rank == 1:
            retention.claim(0, [streamed, shared], delete_on_release=False)
            retention.claim(0, [consumed])
        else:
            retention.claim(0, [shared])
        left = []
        for step in (0, 2):  # the second sweeps version 1
            retention.on_policy_update(step)
            retention.wait()
            dist.barrier()
            left.append(sorted(f for f in files if os.path.exists(os.path.join(root, f))))
        return {"left": left, "metrics": retention.metrics().as_dict()}
    finally:
        dist.destroy_process_group()
