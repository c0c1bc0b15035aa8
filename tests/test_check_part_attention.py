"""check_part("attention", ...): a learner's attention over the paged cache, from scratch, and its usual mistakes."""
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from tplab.exercises import check_engine, check_part
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MyAttention = define("attention")["MyAttention"]


def test_attention_written_from_scratch_passes_at_tp2_and_tp4():
    assert MyAttention.__mro__[1] is torch.nn.Module                    # not a subclass of tplab's
    for tp in (2, 4):
        result = check_part("attention", MyAttention, tensor_parallel_size=tp)
        assert result.ok is True, result.message


class RepeatedInCache(MyAttention):
    """Repeats K/V to the query heads before storing them, as the student's cache did."""
    def forward(self, q, k, v, kv_cache, meta):
        group = self.num_heads // self.num_kv_heads
        return super().forward(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), kv_cache, meta)


class NoMask(MyAttention):
    def forward(self, q, k, v, kv_cache, meta):
        meta.visible = [torch.ones_like(m) for m in meta.visible]
        return super().forward(q, k, v, kv_cache, meta)


class Tiled(MyAttention):
    """Query head h reads KV head h % H_kv: k.repeat instead of k.repeat_interleave."""
    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v
        out, group = torch.empty_like(q), self.num_heads // self.num_kv_heads
        for b in range(len(meta.seq_lens)):
            s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            keys = k_cache[meta.seq_kv_slots(b)].transpose(0, 1).repeat(group, 1, 1)
            values = v_cache[meta.seq_kv_slots(b)].transpose(0, 1).repeat(group, 1, 1)
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), keys, values,
                                                      attn_mask=meta.visible[b], scale=self.scale).transpose(0, 1)
        return out.flatten(1)


class IgnoresTheCache(MyAttention):
    """Writes the cache, but attends only to this step's own keys and values."""
    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v
        out, group = torch.empty_like(q), self.num_heads // self.num_kv_heads
        for b in range(meta.num_seqs):
            s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            keys, values = (t[s:e].transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
            mask = meta.visible[b][:, -(e - s):]                         # the new keys' columns only
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), keys, values, attn_mask=mask,
                                                      scale=self.scale).transpose(0, 1)
        return out.flatten(1)


class Float64(MyAttention):
    def forward(self, q, k, v, kv_cache, meta):
        return super().forward(q, k, v, kv_cache, meta).double()


class VNotStored(MyAttention):
    """Stores V in a copy of the cache: right in the prefill, the cached values are missing at decode."""
    def forward(self, q, k, v, kv_cache, meta):
        return super().forward(q, k, v, (kv_cache[0], kv_cache[1].clone()), meta)


class ReturnsTheCache(MyAttention):
    def forward(self, q, k, v, kv_cache, meta):
        return super().forward(q, k, v, kv_cache, meta), kv_cache


class ReshapedWrong(MyAttention):
    """A shape error of the learner's own, not the cache write's."""
    def forward(self, q, k, v, kv_cache, meta):
        return super().forward(q, k, v, kv_cache, meta).view(-1, 3)


@pytest.mark.parametrize("impl, words", [
    (VNotStored, "the V cache does not hold sequence 0's values at the slots of its blocks [2, 0]"),
    (IgnoresTheCache, "the prompt's second chunk (after cached keys): attends only to this step's new keys, not to "
                      "the cached ones"),
    (Float64, "returned torch.float64, but the engine runs attention in torch.float32"),
    (RepeatedInCache, "store the KV heads, repeat only for the scores"),
    (NoMask, "the prefill's queries see later keys"),
    (Tiled, "it must read KV head h // (H / H_kv)")])
def test_attention_mistakes_are_named(impl, words):
    result = check_part("attention", impl)
    assert result.ok is False and words in result.message, result.message


@pytest.mark.parametrize("impl, words", [
    (ReturnsTheCache, "forward returned a tuple, not a tensor: return only the (T, H * D) output; the cache is "
                      "written in place"),
    (ReshapedWrong, "shape '[-1, 3]' is invalid for input of size")])
def test_an_error_not_from_the_cache_write_gets_no_hint_about_the_cache(impl, words):
    result = check_part("attention", impl)
    assert result.ok is False and words in result.message and "repeated K/V" not in result.message, result.message


class Skeleton(MyAttention):
    """The solution's cache write, then each sequence's attention with one piece changed (``attend``)."""
    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = self.write(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        for b in range(meta.num_seqs):
            s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            keys, values = (c[self.slots(meta, b)].transpose(0, 1) for c in (k_cache, v_cache))
            out[s:e] = self.attend(q[s:e].transpose(0, 1), keys, values, meta.visible[b]).transpose(0, 1)
        return out.flatten(1)

    def write(self, k, v, kv_cache, meta):
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v
        return k_cache, v_cache

    def slots(self, meta, b):
        return meta.seq_kv_slots(b)

    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale, enable_gqa=True)


class SlotOffByOne(Skeleton):
    def write(self, k, v, kv_cache, meta):
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        k_cache[meta.slot_mapping + 1], v_cache[meta.slot_mapping + 1] = k, v
        return k_cache, v_cache


class BlocksIndexedBySlot(Skeleton):
    def write(self, k, v, kv_cache, meta):
        kv_cache[0][meta.slot_mapping], kv_cache[1][meta.slot_mapping] = k, v
        return (c.view(-1, *c.shape[2:]) for c in kv_cache)


class KVSwapped(Skeleton):
    def write(self, k, v, kv_cache, meta):
        return super().write(v, k, kv_cache, meta)


class NoGQA(Skeleton):
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale)


class ScaledByHeadDim(Skeleton):
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=1 / self.head_dim, enable_gqa=True)


class ScaledBySqrtHeadDim(Skeleton):
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.head_dim ** 0.5, enable_gqa=True)


class InvertedMask(Skeleton):
    def attend(self, q, k, v, visible):
        return super().attend(q, k, v, ~visible)


class OwnKeyHidden(Skeleton):
    def attend(self, q, k, v, visible):
        lq, lk = visible.shape
        return super().attend(q, k, v, torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq - 1))


class IsCausal(Skeleton):
    """SDPA's own causal mask: query i sees keys 0..i, right in a prefill, the first key only at decode."""
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)


class IsCausalForSeveralQueries(Skeleton):
    """is_causal where a step has several queries, no mask for one: right in a first prefill and at decode, wrong
    for a prompt's later chunk (chunked prefill, or a prefix from the cache), whose queries follow cached keys."""
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[1] > 1, scale=self.scale, enable_gqa=True)


class WholeBlocks(Skeleton):
    """Reads every slot of the sequence's blocks, the ones it has not filled too."""
    def slots(self, meta, b):
        size = 4                                                          # the probe's block_size
        return torch.cat([torch.arange(block * size, (block + 1) * size) for block in meta.block_tables[b]])


class WritesACopy(Skeleton):
    """Writes K/V into a copy of the cache and attends over the copy: the engine's cache never sees them."""
    def write(self, k, v, kv_cache, meta):
        return (c.view(-1, *c.shape[2:]).index_copy(0, meta.slot_mapping, x) for c, x in zip(kv_cache, (k, v)))


class HeadsLast(Skeleton):
    """Hands SDPA q as (Lq, H, D), as the step packs it, not heads first."""
    def attend(self, q, k, v, visible):
        return super().attend(q.transpose(0, 1), k, v, visible).transpose(0, 1)


class WholeBlocksNoMask(WholeBlocks):
    """Reads every slot of its blocks, then drops the mask that no longer fits."""
    def attend(self, q, k, v, visible):
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True)


class EverySequencesKeys(Skeleton):
    def slots(self, meta, b):
        return meta.kv_slots


class WholeCache(Skeleton):
    def slots(self, meta, b):
        return torch.arange(16)                                           # the probe's 4 blocks x 4 slots


@pytest.mark.parametrize("impl, words", [
    (IsCausal, "the prompt's second chunk (after cached keys): the queries are lined up with the first keys, not "
               "the last: is_causal=True in F.scaled_dot_product_attention lets query i see keys 0..i"),
    (IsCausalForSeveralQueries, "the prompt's second chunk (after cached keys): the queries are lined up with the "
                                "first keys, not the last"),
    (WholeBlocks, "Sequence 0 has 3 keys so far (meta.visible[b] is (Lq, Lk) = (3, 3)), but 8 were read: every "
                  "slot of sequence 0's blocks (2 x 4, also the ones it has not filled). Read exactly its keys"),
    (EverySequencesKeys, "Sequence 0 has 3 keys so far (meta.visible[b] is (Lq, Lk) = (3, 3)), but 5 were read: "
                         "every sequence's keys (meta.kv_slots, all of them packed)"),
    (WholeBlocksNoMask, "prefill: reads every slot of the sequence's blocks, also the ones it has not filled (zeros), "
                        "and drops the mask"),
    (WritesACopy, "the cache is still all zeros after the prefill: write into kv_cache's own storage, in place"),
    (HeadsLast, "Hint: F.scaled_dot_product_attention takes heads first, (H, Lq, D) and (H_kv, Lk, D)"),
    (WholeCache, "but 16 were read: the whole cache. Read exactly its keys: meta.seq_kv_slots(b)"),
    (SlotOffByOne, "the K cache does not hold sequence 0's keys at the slots of its blocks [2, 0]: they are 1 slot "
                   "later; write them at meta.slot_mapping as it is"),
    (BlocksIndexedBySlot, "A slot counts token rows, not blocks: view each cache (num_blocks, block_size, H_kv, D) as "
                          "(num_blocks * block_size, H_kv, D)"),
    (KVSwapped, "it holds the values; k goes to kv_cache[0], v to kv_cache[1]"),
    (NoGQA, "The queries have H = 4 heads, the keys and values H_kv = 2: each KV head serves H / H_kv = 2 query "
            "heads (enable_gqa=True"),
    (ScaledByHeadDim, "the scores are scaled by 1 / head_dim"),
    (ScaledBySqrtHeadDim, "the scores are multiplied by sqrt(head_dim): divide by it"),
    (InvertedMask, "the mask is inverted: meta.visible[b] is True where a query may attend"),
    (OwnKeyHidden, "a query does not see its own key")])
def test_attention_cache_and_gqa_mistakes_are_named(impl, words):
    result = check_part("attention", impl)
    assert result.ok is False and words in result.message, result.message
    assert "repeated K/V" not in result.message, result.message


def test_check_engine_says_a_first_token_off_comes_from_a_prefill_not_the_decode_steps():
    """Served with a block manager (prefix caching on), an attention wrong only after cached keys changes the first
    token of a prompt whose prefix was cached: a prefill's, which the verdict must not blame on decode steps."""
    parts = {"attention": IsCausalForSeveralQueries, "block_manager": define("block_manager")["MyBlockManager"]}
    result = check_engine(parts)
    assert result.ok is False and "the first already, which a prefill samples. Serving adds prompts whose prefix " \
        "comes from the prefix cache" in result.message, result.message
    assert "decode steps go wrong" not in result.message
