"""Loading pitfalls: an LM head nothing loads (zeros, or HF's random initialisation), the full
checkpoint read on every rank."""
import torch
import torch.nn.functional as F

from tplab.layers.embed_head import ParallelLMHead
from tplab.models.loader import LoadReport, checkpoint_files, default_weight_loader, destination, expert_targets


class UnloadedLMHead(ParallelLMHead):
    """An LM head that computes logits with a weight nothing ever loads or ties: all zeros.

    Review notes: "weight_loader.py 在没有 safetensors 的情况下会用 AutoModel.from_pretrained 加载 state_dict。
    这通常不包含 lm_head ... logits head 没正确加载/没 tie embedding，就很容易出现'永远偏向某个
    token'的坍缩" (AutoModel has no lm_head; a head neither loaded nor tied locks generation onto
    one token). Its ``weight`` is tied or loaded as usual, but ``forward`` uses ``unloaded``, which
    keeps its initial value. Every logit is 0: greedy picks token 0 forever at logprob
    ``-log(vocab)``, and no error, since nothing checks the head that is actually used."""

    def __init__(self, num_embeddings, embedding_dim, tp_rank=None, tp_size=None):
        super().__init__(num_embeddings, embedding_dim, tp_rank=tp_rank, tp_size=tp_size)
        self.register_buffer("unloaded", self.initial_weight(), persistent=False)

    def initial_weight(self) -> torch.Tensor:
        return torch.zeros_like(self.weight)

    def forward(self, hidden, gather_output: bool = True):
        logits = F.linear(hidden, self.unloaded)                    # not self.weight: (N, per_rank)
        return self.gather(logits) if gather_output else logits


class RandomLMHead(UnloadedLMHead):
    """An untied LM head left at its random initialisation, as building the model and loading only the
    base model's weights leaves it.

    Review notes: "你当前 weight_loader.py 的 fallback 用 AutoModel 而不是 AutoModelForCausalLM（会导致
    lm_head/输出头缺失或不一致）... 如果是 tied weights，显式 tie" (AutoModel, not AutoModelForCausalLM:
    the lm_head is missing or inconsistent; tie it explicitly when the weights are tied). Instantiating
    ``Qwen2ForCausalLM`` and filling it from the base model's state dict leaves ``lm_head.weight`` as HF
    initialised it: ``normal(0, initializer_range = 0.02)``. Here that matrix comes from one seed, row
    block by row block, so every rank holds its rows of the same matrix at every TP size. The hidden
    states are exact through the final norm; the logits are finite, confident and wrong (a random
    projection of the right hidden state), and nothing raises.
    """
    # STD: HF's default initializer_range. A seed per block of ROWS_PER_SEED rows lets each rank draw only its own
    # rows and still hold the same matrix at every TP size; 1_000_003 (a prime) keeps two SEEDs' blocks apart.
    SEED, STD, ROWS_PER_SEED = 0, 0.02, 64

    def initial_weight(self) -> torch.Tensor:
        weight = torch.zeros(self.weight.shape, dtype=torch.float32)            # (per_rank, E); padding rows 0
        first, last = self.vocab_start, self.vocab_start + self.num_real_rows   # this rank's real rows
        for block in range(first // self.ROWS_PER_SEED, -(-last // self.ROWS_PER_SEED)):
            start = block * self.ROWS_PER_SEED                                  # global row of the block
            gen = torch.Generator(device="cpu").manual_seed(self.SEED * 1_000_003 + block)
            rows = torch.randn(self.ROWS_PER_SEED, self.embedding_dim, generator=gen, device="cpu") * self.STD
            lo, hi = max(first, start), min(last, start + self.ROWS_PER_SEED)
            weight[lo - first:hi - first] = rows[lo - start:hi - start]
        return weight.to(self.weight.device, self.weight.dtype)


def full_load_per_rank_load(model, model_dir, skip=frozenset()) -> LoadReport:
    """Every rank reads the whole checkpoint, then narrows in memory.

    Review notes: "load_and_shard_state_dict currently loads the full state dict on every rank ...
    memory-wise you still hold full tensors in wrapper.state_dict on each rank" (每 rank load 全量
    state_dict, 不影响正确性). The answers are right; I/O and peak memory are not (each rank's peak
    holds the whole checkpoint on top of its shard): ``elements_read`` is the whole checkpoint on
    every rank, against about ``1 / tp_size`` of it with ``tplab.models.loader.load_weights``,
    which reads slices (``safe_open(...).get_slice``)."""
    from safetensors.torch import load
    params, names, elements_read = dict(model.named_parameters()), set(), 0
    experts = expert_targets(model)                       # an MoE checkpoint's per-expert names
    for path in checkpoint_files(model_dir):
        # Every tensor, whole, in this rank's memory, as torch.load / AutoModel's state dict would be
        # (safetensors.torch.load_file would map the file instead and hide the cost).
        state_dict = load(path.read_bytes())
        elements_read += sum(t.numel() for t in state_dict.values())
        for name, tensor in state_dict.items():
            if name not in skip:
                _, param, args = destination(model, params, experts, name, path)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, *args)
                names.add(name)
    return LoadReport(names, elements_read)
