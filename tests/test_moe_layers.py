"""The MoE layer alone (``tplab.layers.moe``), every rank's shard built in one process: the router is HF's to
the bit in fp32 and bf16, the shards' partial sums add up to HF's experts (split by TP or placed whole by
expert parallelism), and each rank reads only what it holds."""
import pytest
import torch

from tplab import tolerance
from tplab.layers.moe import FusedMoE, make_expert_params_mapping
from tplab.models.loader import LazySlice

E, K, H, I = 8, 2, 64, 32          # experts, top-k, hidden size, expert intermediate size


def hf_moe_block(norm_topk_prob: bool, seed: int = 0):
    """HF's Qwen3-MoE block (router + experts) with random weights, fp32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=norm_topk_prob)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    return block


class FakeSlice:
    """A checkpoint tensor as the loader hands it, counting the elements read (``LazySlice``'s interface)."""

    def __init__(self, tensor, reads):
        self.tensor, self.reads = tensor, reads

    @property
    def shape(self):
        return tuple(self.tensor.shape)

    def narrow(self, dim, start, length):
        return FakeSlice(self.tensor.narrow(dim, start, length), self.reads)

    def materialize(self):
        self.reads.append(self.tensor.numel())
        return self.tensor


def checkpoint_tensors(block) -> dict[str, torch.Tensor]:
    """The Hub's per-expert tensors of HF's stacked experts: ``experts.3.gate_proj.weight`` ..."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    out = {}
    for e in range(E):
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = gate_up[e].chunk(2, dim=0)
        out[f"experts.{e}.down_proj.weight"] = down[e]
    return out


def load_shard(block, tp_rank, tp_size, ep, reads=None):
    """One rank's ``FusedMoE`` (partial sums), filled as the loader fills it, through ``weight_loader``."""
    layer = FusedMoE(E, K, H, I, renormalize=block.gate.norm_topk_prob, reduce_results=False, tp_rank=tp_rank,
                     tp_size=tp_size, enable_expert_parallel=ep)
    tensors = checkpoint_tensors(block)
    for param_name, weight_name, expert_id, shard_id in make_expert_params_mapping(E):
        param = getattr(layer, param_name.split(".")[1])
        param.weight_loader(param, FakeSlice(tensors[weight_name], [] if reads is None else reads), shard_id, expert_id)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_is_hfs_to_the_bit(norm_topk_prob, dtype):
    """Softmax in fp32, top-k, renormalised or not, cast to the model's dtype: HF's ids and weights exactly."""
    block = hf_moe_block(norm_topk_prob).to(dtype)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        logits = torch.nn.functional.linear(x, block.gate.weight)
    weights, ids = FusedMoE(E, K, H, I, renormalize=norm_topk_prob, tp_size=1, tp_rank=0).select_experts(logits, dtype)
    assert torch.equal(ids, hf_ids) and weights.dtype == hf_weights.dtype == dtype
    assert torch.equal(weights, hf_weights)
    sums = weights.float().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-2) == norm_topk_prob   # the check can fail


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_partial_sums_add_up_to_hfs_experts(tp, ep):
    block = hf_moe_block(norm_topk_prob=True)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = block(x[None])[0]                                            # HF's routed sum (T, H)
        logits = block.gate(x)[0]
        shards = [load_shard(block, r, tp, ep) for r in range(tp)]
        partial = [s(x, logits) for s in shards]
    assert all(s.num_local_experts == (E // tp if ep else E) for s in shards)
    assert tolerance.within(sum(partial), ref), f"max diff {(sum(partial) - ref).abs().max():.2e}"
    if tp > 1:                                                              # no rank alone has the answer
        assert not any(tolerance.within(p, ref) for p in partial)


def test_expert_parallel_ranks_hold_whole_experts_and_read_only_theirs():
    block = hf_moe_block(norm_topk_prob=False)
    hf = block.experts                                                      # stacked: (E, 2I, H), (E, H, I)
    total = sum(t.numel() for t in checkpoint_tensors(block).values())
    for r in range(4):
        reads = []
        layer = load_shard(block, r, 4, ep=True, reads=reads)
        assert layer.local_experts == range(2 * r, 2 * r + 2)
        assert torch.equal(layer.gate_up_proj, hf.gate_up_proj[2 * r:2 * r + 2])    # [gate | up], whole
        assert torch.equal(layer.down_proj, hf.down_proj[2 * r:2 * r + 2])
        assert sum(reads) == total // 4
    reads = []
    layer = load_shard(block, 1, 4, ep=False, reads=reads)                 # TP: a quarter of every expert
    i = I // 4
    gate, up = hf.gate_up_proj[:, i:2 * i], hf.gate_up_proj[:, I + i:I + 2 * i]
    assert torch.equal(layer.gate_up_proj, torch.cat([gate, up], dim=1))
    assert torch.equal(layer.down_proj, hf.down_proj[:, :, i:2 * i]) and sum(reads) == total // 4


def test_dispatch_sends_each_choice_to_its_expert_once():
    layer = FusedMoE(E, K, H, I, tp_rank=1, tp_size=2, enable_expert_parallel=True)     # experts 4..7
    ids = torch.tensor([[0, 5], [7, 4], [4, 1], [2, 3]])
    got = {(layer.local_experts[local], int(row), int(slot))
           for local, rows, slots in layer.rows_by_expert(ids) for row, slot in zip(rows, slots)}
    assert got == {(5, 0, 1), (7, 1, 0), (4, 1, 1), (4, 2, 0)}


def test_the_loader_refuses_an_expert_the_model_does_not_have(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(I, H)}, tmp_path / "x.safetensors")
    layer = FusedMoE(E, K, H, I, tp_rank=0, tp_size=1)
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        with pytest.raises(ValueError, match="expert 8: the model has 8 experts"):
            layer.weight_loader(layer.gate_up_proj, LazySlice(f.get_slice("w"), "w"), 0, 8)
