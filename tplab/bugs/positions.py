"""The decode-position pitfall, and what a shifted position does when nothing stops it."""
import torch

from tplab.engine.model_runner import token_positions
from tplab.engine.probe import load_model, probe


def offby1_token_positions(seq):
    """Decode positions one ahead of the cache: the new token gets ``len(seq)``, not ``len(seq) - 1``.

    Review notes: "cache 的长度必须严格等于'当前 position'所代表的历史长度，否则 attention 会看错位置"
    (the cache length must strictly equal the current position), with the asserts it asked for:
    ``assert k_cache.shape[2] == position_ids.item()``. ``build_metadata`` is that assert, so
    generate raises a ValueError naming the position and the cache length. To see what the wrong
    position does to the numbers without the check, call ``decode_with_positions`` (one step) or
    ``greedy_with_positions`` (a whole continuation).
    """
    positions = token_positions(seq)
    if not seq.output_token_ids:                                    # prefill: right
        return positions
    return [p + 1 for p in positions]                               # decode: len(seq), new token included


_models: dict[str, torch.nn.Module] = {}   # called in loops: one TP-1 model per folder


def _model(model_dir) -> torch.nn.Module:
    key = str(model_dir)
    if key not in _models:
        _models[key] = load_model(key)
    return _models[key]


def decode_with_positions(model_dir, prompt: list[int], position_shift: int = 1) -> torch.Tensor:
    """Logits ``(vocab,)`` of decoding ``prompt[-1]`` at position ``len(prompt) - 1 + position_shift``.

    Prefills ``prompt[:-1]``, then decodes the last token with its K/V in the right cache slot but
    RoPE at the shifted position: what ``decode_position_offby1`` would compute if the engine did
    not stop it. ``position_shift=0`` gives HF's logits for the last prompt token (TP 1, CPU).
    """
    model, n = _model(model_dir), len(prompt)
    prefill = probe(model, prompt[:-1], max_len=n)
    return probe(model, prompt[-1:], positions=[n - 1 + position_shift], cache=prefill.cache).logits[0]


def greedy_with_positions(model_dir, prompt: list[int], max_new_tokens: int, position_shift: int = 1,
                          follow: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``prompt`` when every decoded token sits ``position_shift`` places ahead, and the
    logits ``(max_new_tokens, vocab)`` each step saw.

    The prompt is prefilled at the right positions (as ``decode_position_offby1`` does); each generated
    token is then fed at position ``cache length + position_shift``, so its RoPE and the key it leaves
    in the cache are both shifted, and every later step attends over those keys. ``follow`` feeds these
    tokens instead of the argmax (to compare step by step along another run's tokens).
    ``position_shift=0`` is HF's greedy continuation (TP 1, CPU).
    """
    model = _model(model_dir)
    out = probe(model, prompt, max_len=len(prompt) + max_new_tokens)
    tokens, logits = [], []
    for step in range(max_new_tokens):
        logits.append(out.logits[-1])
        tokens.append(int(out.logits[-1].argmax()) if follow is None else int(follow[step]))
        if step + 1 < max_new_tokens:
            n = out.cache.num_tokens                                # tokens already cached
            out = probe(model, tokens[-1:], positions=[n + position_shift], cache=out.cache)
    return tokens, torch.stack(logits)
