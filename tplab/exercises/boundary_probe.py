"""``check_part("pipeline_stage")``'s boundary, in t x 2 real ranks: stage 0 sends two known ``(hidden, residual)``
pairs, a prefill's rows and then a decode step's, and each TP rank of stage 1 receives them. Every point-to-point
call the part makes goes through ``P2PWatch`` (``dist_watch.patched``), which keeps what gloo would lose and
refuses what would hang or abort the engine, so each such mistake is named from the call itself, in seconds:

- a send that waits for its receiver (``dist.send``, or ``wait()`` on the request it just made): gloo's send
  completes only once the peer posts its recv, which in the engine comes a tick later, after every rank ends this one;
- a request dropped before ``wait()``: gloo loses a message whose request is garbage-collected (the watch keeps it);
- a peer other than the same TP rank one stage away: refused, not sent;
- a recv buffer of another shape or dtype than what was sent: refused before gloo sees it (gloo would abort the
  rank, "Received data size doesn't match expected size"); the message is drained into the right buffer instead.

Each message's shape and dtype travel ahead of it through the process group's store, as do the ranks' last words.
"""
import json
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tplab.exercises import dist_watch

E, PP = 8, 2
ROWS = (5, 1)                       # a prefill's rows, then a decode step's: a recv that reuses its buffers shows
DTYPES = (torch.float32, torch.bfloat16)    # and in another dtype: a recv that ignores its dtype shows too
WORDS = {  # what the watch saw, worded; {who} is the rank, {what} what it did
    "peer": "{who}: {what}; its peer is world rank {peer}, the same TP rank one stage away: a stage's peer is "
            "world rank (pp_rank +/- 1) * tp_size + tp_rank",
    "blocking": "{who}: {what} (a blocking send). gloo's send completes only when the receiving rank posts its "
                "recv, and in the engine the next stage posts it in its next tick, which starts after every rank "
                "has ended this one (the last stage's tokens are broadcast to all): a send that waits for it waits "
                "for ever, until the ranks' timeout. Start both sends with isend, keep the requests, and wait() on "
                "them at the next send, when that pair has long been received",
    "dropped": "{who}: its send dropped {what} requests isend returned, without wait(). gloo loses a message whose "
               "request is garbage-collected before it has left, and the next stage waits for it for ever (the check "
               "kept them). Keep them (self._sending = [isend(...), isend(...)]) and wait() on them at the next "
               "send, before replacing them",
    "buffer": "{who}: its recv made {what} for the {sent} the previous stage sent. gloo aborts a rank whose "
              "buffer is not the size of the message (\"Received data size doesn't match expected size\"), and "
              "reads the bytes as another dtype where only the dtype differs. Make each buffer torch.empty(rows, "
              "hidden_size, dtype=dtype, device=device) from the arguments recv is given (they change: a "
              "prefill's rows, then a decode step's; the dtype is the model's, bf16 as well as fp32)",
    "nothing": "{who}: its {what} waited for a tensor the previous stage never sent (it sent {sent}): send and "
               "recv must match one for one, hidden then residual",
    "stuck": "{who}: {what} within {seconds:.3g} s",
}


class Refused(BaseException):
    """A point-to-point call the watch did not make (a BaseException: a learner's ``except Exception`` keeps out)."""


def pairs(tp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[tp_rank][k]``: the ``(hidden, residual)`` that TP rank sends as its k-th pair, all different."""
    gen = torch.Generator().manual_seed(tp)
    return [[(torch.randn(rows, E, generator=gen).to(dtype), (10 + torch.randn(rows, E, generator=gen)).to(dtype))
             for rows, dtype in zip(ROWS, DTYPES)] for _ in range(tp)]


class Request:
    """What the watched ``isend`` returns in place of gloo's request: ``wait()`` tells the watch."""

    def __init__(self, watch, real, state):
        self._watch, self._real, self._state = watch, real, state

    def wait(self, timeout=None):
        self._state["waited"] = True
        if self._state["send"] is not None and self._watch.in_send == self._state["send"]:
            self._watch.problem(1, "blocking", "its send called wait() on the request isend had just returned")
        return self._watch.finish_one(self._real, "the send it waits on was never received")

    def __getattr__(self, name):                        # is_completed, exception, get_future...: gloo's own
        return getattr(self._real, name)


class P2PWatch:
    """This rank's point-to-point calls, checked against the layout (world rank = pp_rank * tp + tp_rank)."""

    def __init__(self, run_id: str, tp: int, seconds: float):
        self.rank, self.tp, self.run_id = dist.get_rank(), tp, run_id
        self.seconds, self.end = seconds, time.monotonic() + seconds    # every wait of the probe ends by then
        stage, tp_rank = divmod(self.rank, tp)
        self.who = f"rank {self.rank} (stage {stage}, TP rank {tp_rank})"
        self.next, self.prev = (stage + 1) * tp + tp_rank, (stage - 1) * tp + tp_rank
        self.store, self.isend0, self.irecv0 = c10d._get_default_store(), c10d.isend, c10d.irecv
        self.sent = self.received = 0
        self.kept, self.states, self.problems, self.in_send, self.waits = [], [], [], None, {}

    def wrappers(self) -> dict:
        return {"isend": lambda _: self.isend, "send": lambda _: self.send, "irecv": lambda _: self.irecv,
                "recv": lambda _: self.recv}

    def problem(self, priority: int, kind: str, what: str, **extra) -> None:
        self.problems.append((priority, self.rank, WORDS[kind].format(who=self.who, what=what, **extra)))

    def key(self, src: int, dst: int, n: int) -> str:
        """Where the shape and dtype of the ``n``-th tensor ``src`` sends ``dst`` are put."""
        return f"{self.run_id}/{src}->{dst}/{n}"

    def done_key(self, rank: int) -> str:
        """Where a sending rank puts how many tensors it sent, once it has finished."""
        return f"{self.run_id}/done/{rank}"

    def _start(self, tensor, dst, how):
        if dst != self.next:
            self.problem(0, "peer", f"{how} to world rank {dst}{' (itself)' * (dst == self.rank)}", peer=self.next)
            raise Refused(how)
        self.store.set(self.key(self.rank, dst, self.sent), json.dumps([list(tensor.shape), str(tensor.dtype)]))
        self.sent += 1
        real = self.isend0(tensor.contiguous(), dst)
        self.kept.append(real)                      # gloo loses a message whose request is dropped: never here
        return real

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        state = {"send": self.in_send, "waited": False}
        request = Request(self, self._start(tensor, dst, "isend"), state)
        state["alive"] = weakref.ref(request)
        self.states.append(state)
        return request

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.problem(1, "blocking", "its send used dist.send, which returns only once the peer has received")
        self.finish_one(self._start(tensor, dst, "send"), "the send was never received")

    def finish_one(self, real, why: str) -> bool:
        """``real.wait()`` once (gloo's requests say they are complete only once waited on, and a second wait may
        not return), given up at the probe's end: then it is left waiting in a thread, and the ranks are not kept."""
        if id(real) not in self.waits:                  # the request is kept with its event: its id stays its own
            self.waits[id(real)] = real, threading.Event()
            threading.Thread(target=lambda done=self.waits[id(real)][1]: (real.wait(), done.set()), daemon=True).start()
        if not self.waits[id(real)][1].wait(max(0.0, self.end - time.monotonic())):
            self.problem(5, "stuck", why, seconds=self.seconds)
            raise Refused(why)
        return True

    def _arrives(self, key: str) -> bool:
        """Whether the tensor under ``key`` was sent: True once its shape is in the store, False once the sender
        said it is done without it (or at the probe's end)."""
        done = self.done_key(self.prev)
        while time.monotonic() < self.end:
            if self.store.check([key]):
                return True
            if self.store.check([done]):
                return self.store.check([key])
            time.sleep(0.002)
        return False

    def _sent_as(self, n: int):
        shape, dtype = json.loads(self.store.get(self.key(self.prev, self.rank, n)))
        return shape, getattr(torch, dtype.removeprefix("torch."))

    def _drain(self, n: int) -> None:
        """Receive message ``n`` into a buffer of its own shape and dtype, so that no send is left waiting."""
        shape, dtype = self._sent_as(n)
        self.finish_one(self.irecv0(torch.empty(shape, dtype=dtype), self.prev), "a message was never received")
        self.received = n + 1

    def _receive(self, tensor, src):
        n = self.received
        if src is not None and src != self.prev:
            self.problem(0, "peer", f"recv from world rank {src}{' (itself)' * (src == self.rank)}", peer=self.prev)
            raise Refused("peer")
        if not self._arrives(self.key(self.prev, self.rank, n)):
            done = self.done_key(self.prev)
            sent = self.store.get(done).decode() if self.store.check([done]) else "nothing"
            self.problem(4, "nothing", f"recv number {n + 1}", sent=sent)
            raise Refused("nothing")
        shape, dtype = self._sent_as(n)
        if (list(tensor.shape), tensor.dtype) != (shape, dtype):
            self._drain(n)
            mine, theirs = (f"{tuple(s)} {d} {kind} of {torch.Size(s).numel() * d.itemsize} B" for s, d, kind in
                            ((tensor.shape, tensor.dtype, "buffer"), (shape, dtype, "tensor")))
            self.problem(3, "buffer", f"a {mine}", sent=theirs)
            raise Refused("buffer")
        self.received = n + 1
        return self.irecv0(tensor, self.prev)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return self._receive(tensor, src)

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.finish_one(self._receive(tensor, src), "a recv never completed")
        return self.prev

    def after_send(self) -> None:
        """After each send: the requests made so far that the part let go of without waiting on them."""
        dropped = [s for s in self.states if s["alive"]() is None and not s["waited"] and not s.get("seen")]
        for s in dropped:
            s["seen"] = True
        if dropped:
            self.problem(2, "dropped", f"{len(dropped)} of the {len(self.states)}")

    def finish(self, sender: bool) -> bool:
        """The ranks' last words: drain what was sent and not received; whether nothing is left in flight."""
        clean, done = True, self.done_key(self.prev)
        try:
            if sender:
                self.store.set(self.done_key(self.rank), f"{self.sent} tensor(s)")
                for real in self.kept:
                    self.finish_one(real, "a send was never received")
            else:
                while not self.store.check([done]) or self.store.check([self.key(self.prev, self.rank, self.received)]):
                    if self.store.check([self.key(self.prev, self.rank, self.received)]):
                        self._drain(self.received)
                    elif time.monotonic() > self.end:
                        raise Refused("the previous stage never finished")
                    else:
                        time.sleep(0.002)
        except Refused:
            clean = False
        self.store.set(f"{self.run_id}/clean/{self.rank}", str(int(clean)))
        keys = [f"{self.run_id}/clean/{r}" for r in range(dist.get_world_size())]
        while not self.store.check(keys) and time.monotonic() < self.end + self.seconds / 2:
            time.sleep(0.002)
        return self.store.check(keys) and all(self.store.get(k) == b"1" for k in keys)


def run(blob: bytes, tp: int, run_id: str, seconds: float) -> dict:
    """In each rank of t x 2: stage 0 sends its TP rank's pairs through the part, stage 1 receives them; every
    wait ends within ``seconds`` (the ranks' last words within half as much again)."""
    rank = dist.get_rank()
    tp_rank, pp_rank = rank % tp, rank // tp
    watch, got = P2PWatch(run_id, tp, seconds), None
    with dist_watch.patched(watch.wrappers()):
        impl = dist_watch.load(blob)
        stage = impl(4, pp_rank, PP, tp_rank, tp)
        try:
            if pp_rank == 0:
                for k, pair in enumerate(pairs(tp)[tp_rank]):
                    watch.in_send = k
                    stage.send(*(x.clone() for x in pair))
                    watch.in_send = None
                    watch.after_send()
            else:
                got = [stage.recv(rows, E, dtype, torch.device("cpu")) for rows, dtype in zip(ROWS, DTYPES)]
        except Refused:
            pass
        finally:
            watch.in_send = None
            clean = watch.finish(pp_rank == 0)
    return {"got": got, "problems": watch.problems, "clean": clean}


def problem(results: list[dict], tp: int) -> str | None:
    """The first thing wrong at the boundary (what the watch saw first, then the pairs stage 1 got), or None."""
    seen = sorted(p for r in results for p in r["problems"])
    if seen:
        return f"the boundary at TP {tp} x PP {PP}: {seen[0][2]}"
    return _values_problem([r["got"] for r in results[tp:]], pairs(tp), tp)


def _values_problem(gots, sent, tp: int) -> str | None:
    """``gots[r]``: the pairs stage 1's TP rank r received; ``sent[r]``: what stage 0's TP rank r sent."""
    same = lambda a, b: isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    for rank, got in enumerate(gots):
        for k, pair in enumerate(got):
            hidden, residual = sent[rank][k]
            where = (f"the boundary at TP {tp} x PP {PP}: rank {tp + rank} (stage 1, TP rank {rank}), pair {k + 1} "
                     f"({ROWS[k]} rows)")
            if not isinstance(pair, tuple) or len(pair) != 2:
                return f"{where}: recv must return the pair (hidden, residual), got {type(pair).__name__}" + (
                    ": did you forget `return`?" if pair is None else "")
            if same(pair[0], hidden) and same(pair[1], residual):
                continue
            if any(isinstance(x, torch.Tensor) and x.dtype != DTYPES[k] for x in pair):
                return f"{where}: recv returned {[x.dtype for x in pair]}, asked for {DTYPES[k]}: keep the dtype"
            if same(pair[0], residual) and same(pair[1], hidden):
                return f"{where} received residual and hidden swapped: receive them in the order send sent them"
            if same(pair[0], hidden):
                return (f"{where} received the hidden state but not the residual stream: both must cross (the next "
                        "stage starts from residual + hidden; without the residual it loses every earlier layer)")
            if any(same(pair[0], other[k][0]) for other in sent):
                return (f"{where} received another TP rank's pair: send to the same TP rank of the next stage, world "
                        "rank (pp_rank + 1) * tp_size + tp_rank")
            return f"{where} received {_received_as(pair, hidden, residual)}"
    return None


def _received_as(pair, hidden, residual) -> str:
    """What stage 1's recv returned for the pair (hidden, residual) sent, when it is not that pair."""
    sent = {"hidden": hidden, "residual": residual, "hidden + residual": hidden + residual}
    got = [f"a {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}" if not isinstance(x, torch.Tensor)
           or x.shape != hidden.shape else next((n for n, t in sent.items() if torch.allclose(x, t)),
                                                "other values" if x.any() else "zeros") for x in pair]
    said = f"({got[0]}, {got[1]}) for (hidden, residual)"
    if "hidden + residual" in got:
        return f"{said}: send hidden and residual as they are; the next stage's first layer adds them itself"
    if "zeros" in got or "other values" in got:
        return f"{said}: a buffer nothing was received into? recv(buffer, src) fills it: receive both, in order"
    twice = "the same tensor twice; " if got[0] == got[1] else ""
    return f"{said}: {twice}send hidden, then residual, and receive them in that order"
