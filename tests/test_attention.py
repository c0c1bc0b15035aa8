"""tplab.layers.attention: the metadata of a mixed step, the default ``attend`` and ``Attention`` against a
plain per-sequence softmax attention written from the definition."""
import json
import sys

import pytest
import torch

from tplab.kernels.attend import sdpa_attend
from tplab.kernels.decode_blocks import decode_blocks
from tplab.kernels.paged_decode import dense_decode, paged_decode
from tplab.layers.attention import Attention
from tplab.layers.metadata import build_metadata, causal_visible

H, H_KV, D = 6, 2, 8


def reference_attention(q, k, v, scale):
    """q (Lq, H, D), k/v (Lk, H_kv, D) of one sequence, its queries the last Lq positions: (Lq, H, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)        # (Lk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale      # (H, Lq, Lk)
    lq, lk = q.shape[0], k.shape[0]
    hidden = torch.arange(lk)[None, :] > (lk - lq) + torch.arange(lq)[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def test_causal_visible_is_the_last_lq_of_lk_positions():
    assert causal_visible(1, 4).tolist() == [[True] * 4]
    assert causal_visible(2, 4).tolist() == [[True, True, True, False], [True] * 4]
    assert torch.equal(causal_visible(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_metadata_of_a_mixed_step_reads_exactly_each_sequences_slots():
    # A decodes its 10th token (blocks 3, 1, 4), B is a 3-token prefill (block 0), C a chunk of 2 after 5 cached
    meta = build_metadata([1, 3, 2], [10, 3, 7], [[3, 1, 4], [0], [2, 5]], block_size=4, device="cpu")
    assert meta.positions.tolist() == [9, 0, 1, 2, 5, 6]
    assert meta.slot_mapping.tolist() == [17, 0, 1, 2, 21, 22]
    assert meta.query_start_loc == [0, 1, 4, 6] and meta.kv_start_loc == [0, 10, 13, 20]
    assert meta.seq_kv_slots(0).tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 16, 17]
    assert meta.seq_kv_slots(1).tolist() == [0, 1, 2] and meta.seq_kv_slots(2).tolist() == [8, 9, 10, 11, 20, 21, 22]
    assert meta.kv_slots.numel() == 20                              # no padding to the longest sequence
    assert [tuple(m.shape) for m in meta.visible] == [(1, 10), (3, 3), (2, 7)]
    assert meta.query_lens() == [1, 3, 2]
    dec = decode_blocks([1, 3, 2], [10, 3, 7], [[3, 1, 4], [0], [2, 5]], 4, "cpu")   # A alone decodes: its 3 blocks
    assert dec.seqs == [0] and dec.blocks.tolist() == [3, 1, 4] and dec.num_blocks.tolist() == [3]
    assert dec.past_end.tolist() == [[False] * 4, [False] * 4, [False, False, True, True]]


def test_metadata_refuses_positions_that_disagree_with_the_cache():
    with pytest.raises(ValueError, match=r"token 0 of the step \(sequence 0\) has position 6 but 5 tokens"):
        build_metadata([1], [6], [[0, 1]], 4, "cpu", positions=[6])
    with pytest.raises(ValueError, match="2 positions for a step of 1 new tokens"):     # its right one, and one more
        build_metadata([1], [6], [[0, 1]], 4, "cpu", positions=[5, 6])
    with pytest.raises(ValueError, match="1 positions for a step of 2 new tokens"):     # the first of two only
        build_metadata([2], [6], [[0, 1]], 4, "cpu", positions=[4])
    with pytest.raises(ValueError, match="1 <= query_len <= context_len"):
        build_metadata([3], [2], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="sequence 0 has 9 tokens but 2 blocks of 4 slots"):
        build_metadata([9], [9], [[0, 1]], 4, "cpu")
    with pytest.raises(ValueError, match=r"one block table per sequence, got \[1, 1\] / \[1, 1\] / \[\[0\]\]"):
        build_metadata([1, 1], [1, 1], [[0]], 4, "cpu")                 # the second sequence's table missing


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 37), (5, 5), (4, 19), (33, 33)])
def test_default_attend_equals_the_definition(lq, lk):
    torch.manual_seed(lq * 100 + lk)
    q, k, v = torch.randn(lq, H, D), torch.randn(lk, H_KV, D), torch.randn(lk, H_KV, D)
    out = sdpa_attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal_visible(lq, lk), D ** -0.5)
    assert out.shape == (H, lq, D)
    torch.testing.assert_close(out.transpose(0, 1), reference_attention(q, k, v, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attend", [sdpa_attend, None], ids=["default", "naive"])
def test_attention_writes_kv_heads_and_attends_each_sequence_to_its_own_keys(attend):
    torch.manual_seed(0)
    block_size, lens = 4, [(1, 10), (3, 3), (2, 7), (1, 2)]         # (new tokens, length after the step)
    tables = [[3, 1, 4], [0], [2, 5], [6]]
    cache = (torch.randn(8, block_size, H_KV, D), torch.randn(8, block_size, H_KV, D))
    meta = build_metadata([q for q, _ in lens], [c for _, c in lens], tables, block_size, "cpu")
    t = meta.query_start_loc[-1]
    q, k, v = torch.randn(t, H, D), torch.randn(t, H_KV, D), torch.randn(t, H_KV, D)
    naive = lambda q_, k_, v_, vis, s: reference_attention(q_.transpose(0, 1), k_.transpose(0, 1),
                                                           v_.transpose(0, 1), s).transpose(0, 1)
    out = Attention(H, H_KV, D, attend or naive)(q, k, v, cache, meta)
    assert out.shape == (t, H * D)
    k_flat, v_flat = (c.flatten(0, 1) for c in cache)
    assert torch.equal(k_flat[meta.slot_mapping], k) and torch.equal(v_flat[meta.slot_mapping], v)
    for b in range(meta.num_seqs):                                  # each sequence alone, from the definition
        rows, slots = slice(meta.query_start_loc[b], meta.query_start_loc[b + 1]), meta.seq_kv_slots(b)
        ref = reference_attention(q[rows], k_flat[slots], v_flat[slots], D ** -0.5)
        torch.testing.assert_close(out[rows].view(-1, H, D), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[1, 9, 30, 4, 13], [32], [30], [5], [1]],      # blocks of 4: 32 fills its last
                         ids=["five", "one-32", "one-30", "one-5", "one-1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [paged_decode, dense_decode], ids=["paged", "dense"])
def test_paged_decode_equals_one_sequence_at_a_time(decode, dtype, lens, monkeypatch):
    """Decodes of sequences of very different lengths, attended together, equal each one alone; a single
    sequence (its own path: its blocks are its keys) too, its last block full, partly filled, or one slot.
    ``dense_decode`` (what a GPU runs: padded blocks, one SDPA call) holds to the same reference on the CPU.
    Neither makes a tensor from host data: on a GPU that copy inside the forward makes the host wait."""
    torch.manual_seed(1)
    block_size = 4
    tables = [list(range(i * 8 + 3, i * 8 + 3 + -(-n // block_size)))[::-1] for i, n in enumerate(lens)]
    cache = tuple(torch.randn(40, block_size, H_KV, D, dtype=dtype) for _ in range(2))
    meta = build_metadata([1] * len(lens), lens, tables, block_size, "cpu")
    dec = decode_blocks([1] * len(lens), lens, tables, block_size, "cpu")   # as the engine makes it, before the forward
    q = torch.randn(len(lens), H, D, dtype=dtype)
    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", lambda *a, **k: pytest.fail("a tensor made from host data in the forward"))
        out = decode(q, *cache, dec, D ** -0.5)                    # (B, H, D)
    k_flat, v_flat = (c.flatten(0, 1).float() for c in cache)
    for b in range(len(lens)):
        slots = meta.seq_kv_slots(b)
        ref = reference_attention(q[b:b + 1].float(), k_flat[slots], v_flat[slots], D ** -0.5)[0]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].float(), ref, rtol=tol, atol=tol)


class _DenseAttend(type(sdpa_attend)):
    """tplab's attend with the GPU's decode path (``dense_decode``), so the CPU runs it inside the engine."""

    def attend_decodes(self, q, k_cache, v_cache, decode, scale):
        return dense_decode(q, k_cache, v_cache, decode, scale)

    def __reduce__(self):
        return (_DenseAttend, ())


def test_the_gpus_decode_path_gives_hf_greedy_tokens_inside_the_engine(checkpoint, hf_model):
    """Three sequences of different lengths decoding together (the padded, masked SDPA call), then one alone
    (its keys sliced to its length): HF's greedy tokens, logprobs within HF's bound."""
    import cloudpickle

    from conftest import hf_greedy
    from tplab import LLM, SamplingParams
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    prompts, greedy = [[5, 17, 42, 9, 77, 3, 120, 8, 1, 200, 64, 7, 7, 31, 90, 2, 4, 66], [8, 1, 200], [64]], \
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(checkpoint("gqa"), parts={"attend": _DenseAttend()}) as llm:
        outputs = llm.generate(prompts, greedy) + llm.generate([prompts[0]], greedy)
    for prompt, out in zip(prompts + [prompts[0]], outputs, strict=True):
        ref = hf_greedy(hf_model(checkpoint("gqa")), prompt, greedy.max_tokens)
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


class _CountingAttend(type(sdpa_attend)):
    """tplab's attend, counting the decode tokens it attends together."""
    together = 0

    def attend_decodes(self, q, k_cache, v_cache, decode, scale):
        _CountingAttend.together += q.shape[0]
        return super().attend_decodes(q, k_cache, v_cache, decode, scale)


def test_the_engine_hands_the_decodes_blocks_to_an_attend_that_takes_them_together(checkpoint):
    """The runner asks the attend for its ``decode_inputs`` before the forward; a plain function is never handed
    a step, and both give the same tokens."""
    from tplab import LLM, SamplingParams
    from tplab.layers.attention import plain_attend
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 17, 42, 9], [8, 1, 200]]
    _CountingAttend.together = 0
    with LLM(checkpoint("gqa"), parts={"attend": _CountingAttend()}) as llm:
        together = [out.token_ids for out in llm.generate(prompts, greedy)]
    layers = json.loads((checkpoint("gqa") / "config.json").read_text())["num_hidden_layers"]
    assert _CountingAttend.together == 2 * 3 * layers, "every decode token (2 sequences, 3 steps) in every layer"
    with LLM(checkpoint("gqa"), parts={"attend": plain_attend}) as llm:
        assert [out.token_ids for out in llm.generate(prompts, greedy)] == together
