"""Run under torchrun: every rank joins an env:// process group, builds LLM on it and generates.

    torchrun --standalone --nproc_per_node 2 tests/torchrun_generate.py CHECKPOINT OUT.json
    # TP 2 x PP 2 over two node groups (here both on this machine; on two machines, each its own node_rank):
    torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 --master_addr HOST --master_port PORT \\
        tests/torchrun_generate.py CHECKPOINT OUT.json 2 2

Each rank writes ``OUT.json.rank<N>``: the token ids, and whether its TP collectives went through shared memory.
"""
import json
import sys

import torch
import torch.distributed as dist

from tplab import LLM, SamplingParams
from tplab.distributed import parallel_state

dist.init_process_group("gloo")  # env:// from torchrun; "nccl" on GPUs
tp, pp = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (dist.get_world_size(), 1)
with LLM(sys.argv[1], tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
    outs = llm.generate([[3, 17, 42], [250, 7, 1, 9]], SamplingParams(max_tokens=10, ignore_eos=True))
    shm = parallel_state._shm_for(torch.zeros(1)) is not None
with open(f"{sys.argv[2]}.rank{dist.get_rank()}", "w") as f:
    json.dump({"tokens": [o.token_ids for o in outs], "shm": shm}, f)
dist.destroy_process_group()
