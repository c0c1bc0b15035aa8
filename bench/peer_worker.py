"""One peer engine in its own process and virtual environment, driven by ``bench/peers.py``.

    bench/.peers/vllm/bin/python bench/peer_worker.py vllm CHECKPOINT '{"tp": 1, "dtype": "float32"}'
    bench/.peers/ct2/bin/python bench/peer_worker.py ct2 CHECKPOINT '{"threads": 2}'

It loads the engine once, then reads one JSON command per line on stdin,
``{"prompts": [[token ids], ...], "max_tokens": n}``, runs one greedy generate of every prompt at
once, and answers on stdout with a line ``@@PEER {"seconds": wall time of the call, "tokens": [...]}``
(the marker, because vLLM logs to stdout too). An empty line ends it.
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

MARK = "@@PEER "


def reply(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def vllm_engine(ckpt: str, opts: dict):
    """vLLM's offline ``LLM`` on token-id prompts (no tokenizer: the checkpoint is random)."""
    tp = opts.get("tp", 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if tp == 1 else "|".join(str(i) for i in range(tp)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts.get("kv_gib", 2)))
    from vllm import LLM, SamplingParams
    llm = LLM(model=ckpt, tensor_parallel_size=tp, dtype=opts.get("dtype", "float32"), skip_tokenizer_init=True,
              max_model_len=opts.get("max_model_len", 4096), seed=0, max_num_seqs=opts.get("max_num_seqs", 16),
              # off, as in tplab: the bench sends the same prompts every round, which a prefix cache would skip
              enable_prefix_caching=opts.get("enable_prefix_caching", False))

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def ct2_model(ckpt: str, opts: dict) -> Path:
    """The checkpoint converted for CTranslate2 (once, beside the checkpoint). Its converter wants a
    tokenizer whose vocabulary is the model's: a word-level one over ``t0 .. t{V-1}`` does for random weights."""
    out = Path(ckpt + f"-ct2-{opts.get('compute_type', 'float32')}")
    if (out / "model.bin").is_file():
        return out
    from ctranslate2.converters import TransformersConverter
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    src = Path(ckpt + "-with-tokenizer")
    src.mkdir(exist_ok=True)
    for f in Path(ckpt).iterdir():
        if f.is_file() and not (src / f.name).exists():
            (src / f.name).symlink_to(f)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    # every special token one of the vocabulary's, or the Qwen2 tokenizer class adds its own <|endoftext|>
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0", pad_token="t0",
                            bos_token="t0").save_pretrained(src)
    tmp = Path(str(out) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    TransformersConverter(str(src), low_cpu_mem_usage=True).convert(str(tmp), quantization=opts.get("compute_type"))
    tmp.rename(out)
    return out


def ct2_engine(ckpt: str, opts: dict):
    import ctranslate2
    gen = ctranslate2.Generator(str(ct2_model(ckpt, opts)), device="cpu", compute_type=opts.get("compute_type", "float32"),
                                intra_threads=opts.get("threads", 2), inter_threads=1)

    def generate(prompts, max_tokens):
        results = gen.generate_batch([[f"t{t}" for t in p] for p in prompts], max_length=max_tokens,
                                     min_length=max_tokens, sampling_topk=1, include_prompt_in_result=False,
                                     end_token=[])
        return [list(r.sequences_ids[0]) for r in results]
    return generate


def main():
    kind, ckpt, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}")
    generate = {"vllm": vllm_engine, "ct2": ct2_engine}[kind](ckpt, opts)
    reply({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        t0 = time.perf_counter()
        tokens = generate(cmd["prompts"], cmd["max_tokens"])
        reply({"seconds": time.perf_counter() - t0, "tokens": tokens})


if __name__ == "__main__":  # vLLM's LLM spawns a process: the guard keeps it from rerunning this
    main()
