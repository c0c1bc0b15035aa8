"""A progress bar for ``LLM.generate``, as vLLM draws one: prompts finished, and the token rates so far."""
from tplab.engine.sequence import Sequence


class Progress:
    """vLLM's bar: prompts finished, and the input and output token rates so far."""

    def __init__(self, seqs: list[Sequence]):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=len(seqs), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.num_in = self.num_out = 0

    def finished(self, seq: Sequence) -> None:
        self.num_in += seq.num_prompt_tokens
        self.num_out += len(seq.output_token_ids)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.postfix = (f"est. speed input: {self.num_in / elapsed:.2f} toks/s, "
                            f"output: {self.num_out / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
