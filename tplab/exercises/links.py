"""What a step's collectives cost on the links of notebook 00: ``α + n / β`` per call, with each link's published
figures (one direction), and the bytes a collective sends on the link from one rank: in a ring of ``t`` ranks for
the TP collectives (``dist_watch.sent``, as notebook 07 counts them), and for an all-to-all the bytes of its rows for
other ranks (the rows a rank keeps for itself never leave it). Notebook 08 prices counted runs with these;
notebook 07 writes the same figures and the same ring formula out in its own cells, where it teaches them.
``fit_alpha_beta`` fits ``α + n / β`` to measured latencies: notebook 00 teaches it, notebook 07 fits its sweep with it."""
import numpy as np

from tplab.exercises.dist_watch import sent

# (β bytes per second in one direction, α seconds per call), as notebook 00 prices them: NVLink 4 (half its published
# two-way figure), PCIe Gen5 x16, one InfiniBand NDR port between two machines.
LINKS = {"NVLink": (450e9, 10e-6), "PCIe Gen5": (64e9, 10e-6), "InfiniBand NDR": (50e9, 25e-6)}


def link_bytes(op: str, nbytes: float, ranks: int, to_others: float | None = None) -> float:
    """Bytes one rank sends on the link for a collective of ``nbytes`` put in over ``ranks`` ranks (an
    all-to-all: ``to_others``, its rows for the other ranks)."""
    return float(to_others) if op == "all_to_all" else sent(op, nbytes, ranks)


def price(calls: int, nbytes: float, link: str) -> float:
    """Seconds of ``calls`` collectives that send ``nbytes`` in all from one rank over ``link``: ``calls α + n / β``."""
    beta, alpha = LINKS[link]
    return calls * alpha + nbytes / beta


def fit_alpha_beta(n, t) -> tuple[float, float]:
    """(α seconds, β bytes/s) minimising the relative error of α + n / β against the times ``t`` measured for
    messages of ``n`` bytes (arrays); β is inf when the noise hides any bandwidth term (α is then t's geometric mean)."""
    n, t = np.asarray(n, dtype=float), np.asarray(t, dtype=float)
    A = np.stack([1 / t, n / t], axis=1)                       # each row says (α + n / β) / t = 1
    alpha, inv_beta = np.linalg.lstsq(A, np.ones_like(t), rcond=None)[0]
    if inv_beta <= 0:                                          # no bandwidth term visible in the noise: α alone
        return float(np.exp(np.mean(np.log(t)))), float("inf")
    return float(alpha), float(1 / inv_beta)
