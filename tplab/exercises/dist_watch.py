"""The checkers' view of what a learner's part asks ``torch.distributed`` to do, inside a rank.

``patched(wrappers)`` swaps functions of ``torch.distributed`` (and of ``distributed_c10d``, where they are
defined) for the ``with``'s duration; ``load(blob)`` unpickles the part inside it, so that a cell's
``from torch.distributed import send`` (pickled by reference) finds the wrapper too. ``Collectives`` counts the
collectives a block runs, through ``tplab.distributed.parallel_state`` or ``torch.distributed`` directly, as
``(op, bytes put in)``; ``sent`` prices a record in bytes on the link, as notebook 07 counts a ring.
"""
import contextlib
import sys

import cloudpickle
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tplab.distributed import parallel_state

_HOME = parallel_state.__file__                 # tplab's collectives: recorded by count_collectives already


def sent(op: str, nbytes: float, t: int) -> float:
    """Bytes one rank sends on the link for a collective of ``nbytes`` put in, in a ring of ``t`` ranks."""
    return {"all_reduce": 2 * (t - 1) / t * nbytes, "reduce_scatter": (t - 1) / t * nbytes,
            "all_gather": (t - 1) * nbytes}.get(op, nbytes)


@contextlib.contextmanager
def patched(wrappers: dict):
    """``{name: make(original)}``: ``torch.distributed.<name>`` is ``make(original)`` inside the ``with``."""
    saved = {name: getattr(c10d, name) for name in wrappers}
    try:
        for name, make in wrappers.items():
            setattr(dist, name, make(saved[name]))
            setattr(c10d, name, getattr(dist, name))
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)


def load(blob: bytes):
    """The part ``cloudpickle.dumps``'d in the parent, unpickled here (inside ``patched``)."""
    return cloudpickle.loads(blob)


# op name, and the argument that is the tensor put in (position, keyword; a list: the sum of its tensors)
_COLLECTIVES = {"all_reduce": ("all_reduce", 0, "tensor"), "broadcast": ("broadcast", 0, "tensor"),
                "reduce_scatter": ("reduce_scatter", 1, "input_list"),
                "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
                "all_gather": ("all_gather", 1, "tensor"), "all_gather_into_tensor": ("all_gather", 1, "input_tensor"),
                "all_to_all_single": ("all_to_all", 1, "input"), "all_to_all": ("all_to_all", 1, "input_tensor_list"),
                "reduce": ("reduce", 0, "tensor"), "all_gather_object": ("all_gather_object", 1, "obj")}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(map(_nbytes, x))
    return x.numel() * x.element_size() if hasattr(x, "element_size") else 0     # a pickled object: not counted


class CollectiveRefused(RuntimeError):
    """A collective of ``torch.distributed`` called inside ``Collectives(refuse=True)``; its message is the op."""


class Collectives:
    """``with Collectives() as watch:`` patches the collectives (load the part inside it); then each
    ``with watch.block() as seen:`` fills ``seen`` with the ``(op, bytes put in)`` of the block's collectives.
    With ``refuse``, a collective of ``torch.distributed`` raises ``CollectiveRefused`` instead of running inside
    a block: run on one rank only, it would wait for the others until the timeout."""

    def __init__(self, refuse: bool = False):
        self._seen, self._refuse = None, refuse
        self._patch = patched({n: (lambda o, n=n: self._recorder(n, o)) for n in _COLLECTIVES})

    def __enter__(self):
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)

    def _recorder(self, name, original):
        op, position, keyword = _COLLECTIVES[name]

        def call(*args, **kwargs):
            if self._seen is not None and self._refuse:
                raise CollectiveRefused(op)
            if self._seen is not None and sys._getframe(1).f_code.co_filename != _HOME:   # tplab's: counted anyway
                self._seen.append((op, _nbytes(args[position] if len(args) > position else kwargs[keyword])))
            return original(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def block(self):
        seen: list[tuple[str, int]] = []
        self._seen = seen
        try:
            with parallel_state.count_collectives() as ours:
                yield seen
        finally:
            self._seen = None
            seen.extend((r.op, r.nbytes) for r in ours)
