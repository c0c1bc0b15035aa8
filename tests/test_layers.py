"""Each parallel layer, sharded for every rank in one process, against the dense layer it replaces.

Row-parallel and vocab-parallel layers are built with ``reduce_results=False`` /
``gather_output=False`` and their shards are summed / concatenated by hand, which is
exactly what the all-reduce / all-gather does (tested with real ranks in test_collectives).
"""
import pytest
import torch
from torch import nn

from tplab.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                          RowParallelLinear, VocabParallelEmbedding)
from tplab.layers.weights import WeightShapeError

TP_SIZES = [1, 2, 4]


def dense(in_f, out_f, bias, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(in_f, out_f, bias=bias)
    if bias:
        nn.init.normal_(layer.bias)
    return layer


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_matches_dense(tp):
    ref, x = dense(16, 24, bias=True), torch.randn(5, 16)
    shards = []
    for rank in range(tp):
        layer = ColumnParallelLinear(16, 24, bias=True, tp_rank=rank, tp_size=tp)
        layer.weight_loader(layer.weight, ref.weight.detach())
        layer.weight_loader(layer.bias, ref.bias.detach())
        assert layer.weight.shape == (24 // tp, 16)                 # rows = out_features are split
        torch.testing.assert_close(layer.weight, ref.weight.detach().chunk(tp, 0)[rank], rtol=0, atol=0)
        shards.append(layer(x))
    torch.testing.assert_close(torch.cat(shards, -1), ref(x).detach())


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_matches_dense(tp):
    ref, x = dense(24, 16, bias=True), torch.randn(5, 24)
    partials = []
    for rank in range(tp):
        layer = RowParallelLinear(24, 16, bias=True, reduce_results=False, tp_rank=rank, tp_size=tp)
        layer.weight_loader(layer.weight, ref.weight.detach())
        layer.weight_loader(layer.bias, ref.bias.detach())
        assert layer.weight.shape == (16, 24 // tp)                 # columns = in_features are split
        partials.append(layer(x.chunk(tp, -1)[rank]))
    torch.testing.assert_close(sum(partials), ref(x).detach())      # the bias is counted once


@pytest.mark.parametrize("tp", TP_SIZES)
def test_merged_gate_up_matches_two_dense(tp):
    gate, up, x = dense(16, 32, False, 1), dense(16, 32, False, 2), torch.randn(3, 16)
    outs = []
    for rank in range(tp):
        layer = MergedColumnParallelLinear(16, [32, 32], tp_rank=rank, tp_size=tp)
        layer.weight_loader(layer.weight, gate.weight.detach(), 0)
        layer.weight_loader(layer.weight, up.weight.detach(), 1)
        outs.append(layer(x).chunk(2, -1))                          # [gate rows of rank | up rows of rank]
    torch.testing.assert_close(torch.cat([g for g, _ in outs], -1), gate(x).detach())
    torch.testing.assert_close(torch.cat([u for _, u in outs], -1), up(x).detach())


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 1, 4), (4, 4, 2)])
def test_qkv_parallel_matches_hf_projections(heads, kv_heads, tp):
    d, hidden, x = 8, 32, torch.randn(3, 32)
    q, k, v = dense(hidden, heads * d, True, 1), dense(hidden, kv_heads * d, True, 2), dense(hidden, kv_heads * d, True, 3)
    replicas = max(1, tp // kv_heads)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp)
        for shard_id, ref in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, ref.weight.detach(), shard_id)
            layer.weight_loader(layer.bias, ref.bias.detach(), shard_id)
        assert layer.weight.shape == (layer.q_size + 2 * layer.kv_size, hidden)
        lq, lk, lv = layer.split(layer(x))
        torch.testing.assert_close(lq, q(x).detach().chunk(tp, -1)[rank])
        kv_group = rank // replicas                                 # the KV head this rank's queries use
        torch.testing.assert_close(lk, k(x).detach().chunk(min(tp, kv_heads), -1)[kv_group])
        torch.testing.assert_close(lv, v(x).detach().chunk(min(tp, kv_heads), -1)[kv_group])


@pytest.mark.parametrize("vocab,tp", [(32, 2), (30, 4), (31, 2), (31, 1)])
def test_vocab_parallel_embedding_matches_dense(vocab, tp):
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, 8)
    ids = torch.arange(vocab).flip(0)
    partials = []
    for rank in range(tp):
        layer = VocabParallelEmbedding(vocab, 8, tp_rank=rank, tp_size=tp)
        layer.weight_loader(layer.weight, ref.weight.detach())
        partials.append(layer.lookup_local(ids))                    # what the all-reduce sums
    torch.testing.assert_close(sum(partials), ref(ids).detach())


@pytest.mark.parametrize("vocab,tp", [(32, 2), (30, 4), (31, 2)])
def test_lm_head_pads_vocab_and_matches_dense(vocab, tp):
    torch.manual_seed(0)
    w, h = torch.randn(vocab, 8), torch.randn(4, 8)
    shards = []
    for rank in range(tp):
        head = ParallelLMHead(vocab, 8, tp_rank=rank, tp_size=tp)
        head.weight_loader(head.weight, w)
        assert head.weight.shape[0] == -(-vocab // tp)              # padded to a multiple of tp
        shards.append(head(h, gather_output=False))
    torch.testing.assert_close(torch.cat(shards, -1)[:, :vocab], h @ w.T)
    assert (torch.cat(shards, -1)[:, vocab:] == 0).all()           # padding logits are zero and dropped


@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead])
def test_vocab_weight_loader_zeroes_the_padding_rows_whatever_the_parameter_held(cls):
    """The loader itself zeroes the rows past the real vocabulary (the padding logits ``gather_output=False``
    hands over are documented zeros): not the allocation, which a reload or a ``torch.empty`` leaves dirty."""
    torch.manual_seed(0)
    w = torch.randn(31, 8)
    last = cls(31, 8, tp_rank=1, tp_size=2)                         # rows 16..31 of a padded 32: one padding row
    last.weight.data.normal_()                                      # what the memory held before the load
    last.weight_loader(last.weight, w)
    assert last.num_real_rows == 15 and torch.equal(last.weight[:15], w[16:])
    assert torch.equal(last.weight[15:], torch.zeros(1, 8))


def test_weight_loader_rejects_wrong_full_shape():
    layer = ColumnParallelLinear(16, 24, tp_rank=0, tp_size=2)
    with pytest.raises(WeightShapeError, match=r"expected shape \(24, 16\), found \(16, 24\)"):
        layer.weight_loader(layer.weight, torch.zeros(16, 24))     # transposed: would narrow the wrong dim
    qkv = QKVParallelLinear(32, 8, 4, 2, tp_rank=1, tp_size=2)
    with pytest.raises(WeightShapeError, match=r"expected shape \(16, 32\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(32, 32), "k")


def test_qkv_sizes_come_from_global_head_counts():
    layer = QKVParallelLinear(896, 64, 14, 2, tp_rank=1, tp_size=2)  # Qwen2.5-0.5B at TP 2
    assert (layer.num_heads, layer.num_kv_heads, layer.q_size, layer.kv_size) == (7, 1, 448, 64)
    assert layer.weight.shape == (448 + 2 * 64, 896)


@pytest.mark.parametrize("heads,kv,tp,msg", [
    (14, 2, 4, r"14 query heads are not divisible by 4.*TP sizes that work: \[1, 2, 14\]"),
    (8, 4, 3, r"8 query heads are not divisible by 3"),
    (12, 4, 6, r"6 is not a multiple of the 4 KV heads.*TP sizes that work: \[1, 2, 4, 12\]"),
])
def test_bad_tp_size_names_the_numbers_and_lists_sizes_that_work(heads, kv, tp, msg):
    with pytest.raises(ValueError, match=msg):
        QKVParallelLinear(64, 8, heads, kv, tp_rank=0, tp_size=tp)


def test_rope_layers_share_the_table_and_a_rotation_gets_rows_of_its_own():
    """Every layer rotates by the one table's rows; a rotation (a learner's, a pitfall's) gets rows of
    its own, so one that changes them in place cannot leave the other layers with wrong angles."""
    from tplab.layers.rotary import RotaryEmbedding, apply_rotary

    positions, q, k = torch.tensor([3, 5]), torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    ours = [RotaryEmbedding(8, 64, 10000.0) for _ in range(2)]
    with torch.inference_mode():
        first, second = (rope(positions, q, k) for rope in ours)
    table_cos, table_sin = ours[0].cos_cached[[3, 5]], ours[0].sin_cached[[3, 5]]
    want = apply_rotary(q, k, table_cos, table_sin)
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    def scribble(q, k, cos, sin):                                     # changes its rows in place
        cos.zero_()
        return q, k

    with torch.inference_mode():
        RotaryEmbedding(8, 64, 10000.0, apply_fn=scribble)(positions, q, k)
        after = ours[1](positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(after, want))
    assert ours[0].cos_cached is ours[1].cos_cached                   # one table, not a copy per layer


ROPE_TABLE_FIRST = """
import torch
torch.set_num_threads(2)
from tplab.layers.rotary import _cos_sin_table
cos, sin = _cos_sin_table(64, 512, 10000.0, "cpu")       # the process's first parallel op, if it makes one
torch.set_num_threads(1)                                   # the reference: the same ops, in this thread alone
want_cos, want_sin = _cos_sin_table.__wrapped__(64, 512, 10000.0, "cpu")
print(max(float((cos - want_cos).abs().max()), float((sin - want_sin).abs().max())))
"""


def test_the_rope_table_is_fp32_exact_when_it_is_a_fresh_processs_first_op():
    """The shipped model's table (512 positions, D = 64), built first thing in fresh processes, as a rank or a
    notebook kernel builds it: bitwise the table computed in one thread. Computed as one parallel op, an
    Intel Xeon (AVX-512, 2 threads) gave a worker thread's half up to 1.5e-4 off in 20-50% of processes."""
    import subprocess
    import sys

    for _ in range(10):   # without the fix, 7 of 30 processes were off there: all 10 pass 7% of the time
        out = subprocess.run([sys.executable, "-c", ROPE_TABLE_FIRST], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) == 0.0, f"the RoPE table is {out.stdout.strip()} off"
