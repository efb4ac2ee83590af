"""An RL trainer's data loop on r3data, as verl, SkyRL and prime-rl run theirs: DP shares of each
step in token-budget micro-batches, CP-local rows, replayed experts, payload files freed once every
rank trained the step. torchrun --nproc-per-node 4 examples/trainer_loop.py"""

import os

import torch
import torch.distributed as dist

from r3data.layout import TokenLayout, expand
from r3data.nodes import DataParallel, MicroBatches, loader
from r3data.payload import PayloadRetention, PayloadWriter
from r3data.replay import replay_topk
from r3data.synth import MODEL_SHAPES, SyntheticRouter, serve_rollouts, synth_rollouts

dist.init_process_group("gloo")
rank, world, shape = dist.get_rank(), dist.get_world_size(), MODEL_SHAPES["qwen3-30b-a3b"]
root = os.environ.get("PAYLOAD_ROOT", "/tmp/r3data-example")  # shared by every rank
retention = PayloadRetention(root, max_off_policy_steps=1, fresh=True, group=dist.group.WORLD)
samples = [None]  # what rollout workers hand over: 16 rollouts, half by payload handle
if rank == 0:
    rollouts = synth_rollouts(SyntheticRouter(shape), 16, max_len=2048)
    samples = [serve_rollouts(rollouts, writer=PayloadWriter(root)).samples]
dist.broadcast_object_list(samples)
cp = 2 if world % 2 == 0 else 1  # ranks 2k, 2k+1 share a sequence; every rank builds each DP group
dp = [dist.new_group(list(range(first, world, cp))) for first in range(cp)][rank % cp]
batches = loader(samples[0], batch_size=8, num_experts=shape.num_experts, retention=retention,
    micro_batches=MicroBatches(max_tokens=4096), data_parallel=DataParallel.from_torch(dp),
    layout=TokenLayout(cp_size=cp, cp_rank=rank % cp, layers=shape.layers))  # fmt: skip
gate = torch.nn.Linear(16, shape.num_experts)  # stands in for the model's MoE routers
optimizer = torch.optim.SGD(gate.parameters(), lr=0.1)
for micro in batches:  # this rank's micro-batches, step after step
    for routes in expand(micro["routed_experts"]):  # per MoE layer: [local tokens, topk]
        gates, _ = replay_topk(gate(torch.randn(routes.shape[0], 16)).softmax(-1), routes)
        (-gates.log().mean() / micro.metadata["micro_batches"]).backward()
    if micro.metadata["micro_batch"] + 1 == micro.metadata["micro_batches"]:
        optimizer.step(), optimizer.zero_grad()
        retention.on_policy_update(micro.metadata["step"])  # every rank; rank 0 deletes
        print(f"rank {rank}: step {micro.metadata['step']} trained", flush=True)
retention.close(), dist.barrier(), dist.destroy_process_group()  # ranks leave together
