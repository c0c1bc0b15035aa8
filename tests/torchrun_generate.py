"""Run under torchrun: every rank joins an env:// process group, builds LLM on it and generates.

    torchrun --standalone --nproc_per_node 2 tests/torchrun_generate.py CHECKPOINT OUT.json
"""
import json
import sys

import torch.distributed as dist

from tplab import LLM, SamplingParams

dist.init_process_group("gloo")  # env:// from torchrun; "nccl" on GPUs
with LLM(sys.argv[1], tensor_parallel_size=dist.get_world_size()) as llm:
    outs = llm.generate([[3, 17, 42], [250, 7, 1, 9]], SamplingParams(max_tokens=10, ignore_eos=True))
with open(f"{sys.argv[2]}.rank{dist.get_rank()}", "w") as f:
    json.dump([o.token_ids for o in outs], f)
dist.destroy_process_group()
