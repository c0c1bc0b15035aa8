"""The engine as one rank runs it: build this rank's shard, load its slices, generate.

Every rank runs the same loop on the same requests (SPMD); the only
communication is inside the model's collectives.
"""
import torch

from tplab import bugs
from tplab.config import EngineConfig
from tplab.engine.runner import ModelRunner
from tplab.engine.sampling import SamplingParams
from tplab.engine.sequence import Sequence
from tplab.loader import load_weights
from tplab.models.qwen2 import Qwen2ForCausalLM
from tplab.parallel import tp_rank_and_size


def eos_token_ids(hf_config) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


def build_model(cfg: EngineConfig, device, tp_rank: int | None = None, tp_size: int | None = None):
    """This rank's shard of the model, with its weight slices read from the checkpoint."""
    tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size)
    if tp_size != cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} but the process group has "
                         f"{tp_size} ranks")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(cfg.torch_dtype)  # parameters are created in the target dtype, on the device
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg.hf_config, tp_rank, tp_size, bugs.parts_with(cfg.bugs))
    finally:
        torch.set_default_dtype(default_dtype)
    # HF omits a tied lm_head.weight when saving; some checkpoints keep it anyway.
    skip = frozenset({"lm_head.weight"}) if cfg.hf_config.tie_word_embeddings else frozenset()
    load_weights(model, cfg.model, skip=skip)
    return model.eval()


class LLMEngine:
    """One rank's engine: the model shard, its runner and the generation loop."""

    def __init__(self, cfg: EngineConfig, device):
        self.cfg, self.device = cfg, torch.device(device)
        self.model = build_model(cfg, self.device)
        self.runner = ModelRunner(self.model, self.device, cfg.torch_dtype)
        self.eos_ids = eos_token_ids(cfg.hf_config)
        self.max_model_len = cfg.hf_config.max_position_embeddings

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        """Greedy/sampled continuation of each prompt, all sequences batched in every step.

        Contiguous cache: sequence i owns block i, one block as long as the longest request.
        """
        seqs = [Sequence(i, list(p), len(p), sp, self._generator(i, sp), block_table=[i])
                for i, (p, sp) in enumerate(zip(prompts, params))]
        self.runner.allocate(len(seqs), max(len(p) + sp.max_tokens for p, sp in zip(prompts, params)))
        running = seqs
        while running:  # first step: every prompt's prefill; then one decode token per sequence
            for seq, (token, logprob) in zip(running, self.runner.step(running)):
                seq.append(token, logprob, self.eos_ids, self.max_model_len)
            running = [s for s in running if not s.finished]
        return seqs

    def _generator(self, index: int, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        # The same seed on every rank: every rank draws the same token from the same logits.
        return torch.Generator().manual_seed(params.seed if params.seed is not None else self.cfg.seed + index)
