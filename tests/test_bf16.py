"""bf16: tplab's bf16 engine against HF's own Qwen2 in bf16, on the shipped trained model.

bf16 keeps 8 significant bits, so every matmul input is rounded by up to 2^-9 relative, and two
correct bf16 implementations differ wherever they round or accumulate in another order (oneDNN's
packed bf16 kernel vs HF's path; at TP 2, each rank's partial sum is rounded to bf16 before the
all-reduce). Exactness is fp32's job (test_model_parity.py). What bf16 must keep: the same greedy
tokens on at least ``tolerance.TOKEN_AGREEMENT`` (90%) of the positions, logprobs within the bf16
bound of ``tplab.tolerance`` (2 x 2^-7 x the logits' size) wherever the two still share the context, and
each story's first other token, if any, only at a near-tie: where HF's own pick led its runner-up by no
more than that bound (docs/numerics.md).
(Measured on a Xeon with AMX: bound 0.34; at TP 1 every token equal, logprob differences at most 0.04; at
TP 2 one story of eight parts at its token 12, where HF's pick led by 0.03, the rest equal, differences at
most 0.05.)
"""
import pytest
import torch

from tplab import LLM, SamplingParams, models
from tplab import tolerance

STORIES = ["Once upon a time", "The little dog", "Tom and Lily went to the park", "One day, a girl named Mia",
           "The sun was shining and", "A big red ball", "In the forest there lived", "Ben wanted to fly"]
NEW = 24


@pytest.fixture(scope="module")
def hf_bf16_reference():
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    path = models.tiny_stories()
    tok = AutoTokenizer.from_pretrained(path)
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts, ref, bound, gaps = [tok.encode(t) for t in STORIES], [], 0.0, []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):]
            logits = hf(torch.tensor([p + out.tolist()])).logits[0].float()
            bound = max(bound, tolerance.logprob_bound(logits, torch.bfloat16))
            logprobs = logits.log_softmax(-1)
            ref.append((out.tolist(), [logprobs[len(p) - 1 + i, t].item() for i, t in enumerate(out.tolist())]))
            top2 = logprobs[len(p) - 1:len(p) - 1 + NEW].topk(2, dim=-1).values       # (NEW, 2)
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())       # how far HF's pick led its runner-up
    return prompts, ref, bound, gaps


def assert_agrees_with_hf_bf16(outs, reference) -> None:
    """Greedy tokens equal HF bf16's on ``TOKEN_AGREEMENT`` of the positions, logprobs within the bf16 bound
    wherever the two still share the context, and a story parts from HF's only at a near-tie."""
    prompts, ref, bound, gaps = reference
    agree, worst = 0, 0.0
    assert len(outs) == len(ref) == len(STORIES)
    for story, out, (tokens, logprobs), gap in zip(STORIES, outs, ref, gaps):
        assert len(out.token_ids) == len(out.logprobs) == NEW
        agree += sum(a == b for a, b in zip(out.token_ids, tokens))
        same_context = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), NEW)
        worst = max([worst] + [abs(a - b) for a, b in zip(out.logprobs[:same_context], logprobs[:same_context])])
        assert same_context == NEW or gap[same_context] <= bound, (
            f"{story!r}: token {same_context} differs from HF bf16's where HF's pick led by {gap[same_context]:.3f} "
            f"(more than the bf16 bound {bound:.3f}): not a near-tie")
    rate = agree / (NEW * len(prompts))
    need = tolerance.TOKEN_AGREEMENT[torch.bfloat16]
    assert rate >= need, f"greedy tokens agree with HF bf16 on {rate:.0%} of positions, under {need:.0%}"
    assert worst <= bound, f"logprob off by {worst:.3f} from HF bf16, bound {bound:.3f}"


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_agrees_with_hf_bf16(hf_bf16_reference, tp):
    with LLM(models.tiny_stories(), dtype="bfloat16", tensor_parallel_size=tp) as llm:
        outs = llm.generate(hf_bf16_reference[0], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert_agrees_with_hf_bf16(outs, hf_bf16_reference)


def test_compiled_bf16_parts_from_hf_bf16_only_at_near_ties(hf_bf16_reference):
    """The compiled path in bf16. Inductor's fused kernels keep their intermediates in fp32 and round once,
    where eager ops (tplab's and HF's) round each output, so a near-tie between two tokens can go the other
    way, and from there the continuation differs (measured here: one story parts at its token 12, where HF's
    two best bf16 logits are equal; 180 of 192 tokens equal).
    What must hold: logprobs within the bf16 bound while the context is HF's, and each story's first other
    token chosen where HF's own pick led its runner-up by no more than that bound."""
    prompts, ref, bound, gaps = hf_bf16_reference
    with LLM(models.tiny_stories(), dtype="bfloat16", compile=True) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert llm.stats()["compiled_forwards"] > 0, "the model ran eagerly: compiling failed (see stderr)"
    for story, out, (tokens, logprobs), gap in zip(STORIES, outs, ref, gaps):
        parts = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), NEW)
        worst = max([0.0] + [abs(a - b) for a, b in zip(out.logprobs[:parts], logprobs[:parts])])
        assert worst <= bound, f"{story!r}: logprob off by {worst:.3f} from HF bf16 in its context, bound {bound:.3f}"
        assert parts == NEW or gap[parts] <= bound, (
            f"{story!r}: token {parts} differs from HF bf16's where HF's pick led by {gap[parts]:.3f} "
            f"(more than the bf16 bound {bound:.3f}): not a near-tie")


def test_the_norm_and_the_rotation_are_hfs_bit_for_bit_in_bf16():
    """The bound above is loose enough that a norm computing its statistics in bf16 (HF's are fp32), or a
    rotation in fp32 (HF's is in the activations' dtype), still passes it: one story parts only at a near-tie.
    So the two elementwise pieces where a dtype is chosen are held to HF's bit for bit, and each mistake
    shown to differ."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, Qwen2RotaryEmbedding, apply_rotary_pos_emb
    from tplab.layers.norm import RMSNorm
    from tplab.layers.rotary import RotaryEmbedding, rotate_half
    torch.manual_seed(0)
    x, weight = (3 * torch.randn(7, 256)).to(torch.bfloat16), torch.rand(256) + 0.5
    ours, hf = RMSNorm(256, 1e-6), Qwen2RMSNorm(256, eps=1e-6)
    for norm in (ours, hf):
        norm.weight.data.copy_(weight)
        norm.to(torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
    stats_in_bf16 = ours.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert not torch.equal(stats_in_bf16, hf(x))

    config = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 300, 511, 7])
    q, k = (torch.randn(9, heads, 64).to(torch.bfloat16) for heads in (4, 2))
    rope = RotaryEmbedding(64, 512, 10000.0)
    mine = rope(positions, q, k)
    as_hf = lambda t: t.transpose(0, 1).unsqueeze(0)                        # noqa: E731  (T, H, D) -> (1, H, T, D)
    cos, sin = Qwen2RotaryEmbedding(config)(as_hf(q), positions.unsqueeze(0))
    theirs = [t[0].transpose(0, 1) for t in apply_rotary_pos_emb(as_hf(q), as_hf(k), cos, sin)]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    cos32, sin32 = (t[positions][:, None] for t in (rope.cos_cached, rope.sin_cached))
    in_fp32 = (q.float() * cos32 + rotate_half(q.float()) * sin32).to(torch.bfloat16)
    assert not torch.equal(in_fp32, theirs[0])
