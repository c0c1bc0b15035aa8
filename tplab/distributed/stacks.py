"""Where a hung rank is: before ``RankGroup`` stops ranks that did not answer in time, each writes its Python stack
(``faulthandler``, on SIGUSR1) to a pipe of its own, and the timeout's message says where each one was: the loop
in a learner's part on one rank, the collective waiting for it on the others."""
import faulthandler
import linecache
import os
import re
import signal

ASK = getattr(signal, "SIGUSR1", None)          # None on Windows: no stacks there
_PLUMBING = ("site-packages", "/tplab/distributed/", "/multiprocessing/")


class RanksDidNotAnswer(TimeoutError):
    """A call that ranks ``pending`` did not answer within ``timeout`` seconds, or ``lag`` seconds after the first
    rank answered (``RankGroup.run``'s ``straggle``); ``where`` (from ``where``) says where each one was when every
    rank was stopped."""

    def __init__(self, pending: list[int], timeout: float, world_size: int, where: str, lag: float | None = None):
        if lag is None:
            super().__init__(f"ranks {pending} did not answer within {timeout:g} s; all {world_size} ranks were "
                             f"stopped{where}. A call that was still working (a long generate) needs a larger "
                             "timeout= (LLM(..., timeout=...), launch's)")
        else:
            super().__init__(f"ranks {pending} did not answer within {lag:.0f} s of the first answer; all "
                             f"{world_size} ranks were stopped{where}")
        self.pending, self.where, self.lag, self.world_size = pending, where, lag, world_size

    def stragglers(self) -> str:
        """"rank(s) [1] had not ended, rank(s) [0] had returned; where each was: ..." (with a lag: "... had not
        ended 10 s after rank(s) [0] had returned; ..."), or "" when no rank had returned."""
        done = sorted(set(range(self.world_size)) - set(self.pending))
        if not done:
            return ""
        after = ", " if self.lag is None else f" {self.lag:.0f} s after "
        return f"rank(s) {self.pending} had not ended{after}rank(s) {done} had returned{self.where}"


def answer_when_asked(write_end) -> None:
    """In a rank: dump every thread's stack to ``write_end`` (a ``Connection``) on SIGUSR1."""
    if ASK is not None:
        faulthandler.register(ASK, file=write_end.fileno(), all_threads=True)


def where(pids: dict[int, int], read_ends: dict, wait_s: float = 1.0) -> str:
    """``{rank: pid}`` of ranks that did not answer, asked for their stacks: ``"; where each was: rank 1 at
    file:line in fn: `code`; ..."`` for each that wrote one within ``wait_s`` seconds, or "" when none did."""
    if ASK is None:
        return ""
    for pid in pids.values():
        try:
            os.kill(pid, ASK)
        except OSError:
            pass
    said = []
    for rank in sorted(pids):
        frames = _main_thread(_read_all(read_ends[rank], wait_s))
        if frames:
            said.append(f"rank {rank} at {_describe(frames)}")
    return "; where each was: " + "; ".join(said) if said else ""


def _read_all(conn, wait_s: float) -> str:
    """What a rank wrote: faulthandler writes a stack a few bytes at a time, so read until a pause, or the end of
    the pipe (a rank that died, e.g. of the signal itself before it had registered for it)."""
    chunks, wait = [], wait_s
    while conn.poll(wait):
        chunk = os.read(conn.fileno(), 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        wait = 0.2
    return b"".join(chunks).decode(errors="replace")


def _main_thread(dump: str) -> list[tuple[str, str, str]]:
    """The (file, line, function) frames, innermost first, of the thread that serves the parent's calls."""
    for section in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', section)
        if any(fn == "rank_main" for _, _, fn in frames):
            return [(f, n, fn) for f, n, fn in frames if not f.endswith("rank_process.py")] or frames
    return []


def _describe(frames) -> str:
    """The innermost frame outside torch, numpy and tplab's collectives (else the innermost), with its line of code:
    the learner's loop, or the layer whose collective waits."""
    path, line, function = next((f for f in frames if not any(p in f[0] for p in _PLUMBING)), frames[0])
    code = linecache.getline(path, int(line)).strip()       # a notebook cell's too: the kernel keeps its lines
    return f"{path.split('site-packages/')[-1]}:{line} in {function}" + (f": `{code}`" if code else "")
