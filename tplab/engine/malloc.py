"""Keep freed memory in the process: glibc's defaults cost a CPU engine a page fault per 4 KiB of
every activation.

Each step allocates and frees the same activations again and again. By default glibc serves a
block larger than any freed so far (128 KiB at first, up to 32 MiB) with a fresh ``mmap`` and returns it
with ``munmap`` when freed, and it hands the free top of the heap back to the kernel beyond twice that
threshold. A decode step's KV gathers grow with the context, so they keep outgrowing the threshold: the next
step's tensors land on new pages, and the kernel zero-fills each 4 KiB page on first touch, which makes those
gathers slower than copying the same bytes into memory already mapped (measured: docs/performance-journal.md).
vLLM's CPU backend has the same problem and recommends preloading tcmalloc; raising glibc's two thresholds
(``mallopt``) does the same job without another library. The cost: memory freed after a peak (a long
prefill) stays in the process for the next one.
"""
import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20                       # glibc's maximum on 64-bit: larger blocks are still mmapped
TRIM_THRESHOLD = 1 << 30                        # keep up to 1 GiB of free heap instead of returning it

def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (a rank's, or the driver's at TP 1); True if
    done. The engine calls it when ``EngineConfig.malloc_tune`` (``TPLAB_MALLOC_TUNE=0`` turns it off);
    doing it again changes nothing. A no-op off glibc (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):                   # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
