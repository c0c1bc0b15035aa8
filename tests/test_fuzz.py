"""Property tests over Qwen2 shapes: for every TP size, tplab's logits equal HF's, or the TP size is
refused with the clear error. Never wrong numbers."""
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tplab import golden, models
from tplab.engine.config import EngineConfig
from tplab.distributed.launcher import RankGroup

PROMPT = [5, 1, 16, 3, 9, 12, 2, 7, 4, 15, 11]


@st.composite
def qwen2_shapes(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    return dict(
        num_key_value_heads=kv_heads,
        num_attention_heads=kv_heads * draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([8, 16])),
        hidden_size=draw(st.sampled_from([32, 48])),
        intermediate_size=draw(st.sampled_from([24, 30, 64])),
        vocab_size=draw(st.integers(17, 300)),
        tie_word_embeddings=draw(st.booleans()),
        rope_theta=draw(st.sampled_from([1e4, 1e6])),
        num_hidden_layers=draw(st.integers(1, 2)),
    )


def tp_works(shape, tp):
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    kv_ok = kv % tp == 0 if tp <= kv else tp % kv == 0
    return heads % tp == 0 and shape["intermediate_size"] % tp == 0 and kv_ok


@pytest.fixture(scope="module")
def rank_groups():
    """One long-lived group per TP size, so each example costs a model build, not a spawn."""
    groups = {}

    def get(tp):
        if tp not in groups:
            groups[tp] = RankGroup(tp, backend="gloo", timeout=120)
        return groups[tp]
    yield get
    for group in groups.values():
        group.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=qwen2_shapes(), tp=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 2**16))
def test_logits_match_hf_or_tp_size_is_refused(shape, tp, seed, rank_groups):
    with tempfile.TemporaryDirectory() as folder:
        models.save_random_qwen2(folder, seed=seed, **shape)
        event(f"tp{tp} {'runs' if tp_works(shape, tp) else 'refused'}")
        if not tp_works(shape, tp):
            with pytest.raises(ValueError, match="TP sizes that work"):
                EngineConfig(model=folder, tensor_parallel_size=tp)
            return
        prompt = [t % shape["vocab_size"] for t in PROMPT]
        ref = golden.hf_activations(folder, prompt)["logits"]
        if tp == 1:
            mine = golden.rank_activations(folder, prompt)["logits"]
        else:
            mine = rank_groups(tp).run(golden.rank_activations, (folder, prompt, tp))[0]["logits"]
    assert golden.tolerance.within(mine, ref), f"logits off by {(mine - ref).abs().max():.1e}, bound {golden.bound(ref):.1e}"
