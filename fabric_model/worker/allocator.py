"""Keep a worker's freed memory for its next step instead of handing it back to the kernel.

A training step allocates and frees the same large buffers (activations, gradients'
temporaries) every time. With glibc's defaults, buffers over the dynamic mmap threshold are
``mmap``-ed and unmapped each step, and free memory at the heap's top is trimmed, so every
step faults its pages in again: on the small CNN of benchmarks/README.md, ~4,000 minor faults and 6-9 ms
of system time in a ~30 ms step. Raising the mmap and trim thresholds keeps those pages: the same effect
PyTorch's CPU performance guides get from preloading jemalloc or tcmalloc, with no
library to install. Resident memory then stays at the step's peak rather than dipping
between steps. See docs/architecture.md, "Worker memory".
"""

from __future__ import annotations

import ctypes
import logging

from ..launchers.native import libc

log = logging.getLogger(__name__)

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap and are reused; larger ones are still
#: mapped and unmapped on their own (their page faults are small beside the work on them).
MMAP_THRESHOLD = 256 << 20
#: Free memory at the heap's top kept before trimming: in effect never trimmed while training.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set.

    Does nothing off Linux glibc (musl, macOS and Windows have other allocators). The job's
    ``FABRIC_MODEL_KEEP_FREED_MEMORY`` (``config.keep_freed_memory_setting``, read in the
    caller) decides whether a worker calls it.
    """
    library = libc()
    mallopt = getattr(library, "mallopt", None)
    if mallopt is None:  # not Linux glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either threshold turns off glibc's dynamic adjustment, which would otherwise
    # leave the trim threshold at twice a small mmap threshold: so both, always.
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.info("mallopt refused the thresholds; freed memory is handed back as glibc decides")
    return done


def release_free_memory() -> None:
    """Hand the kernel the free memory of the heap now (``malloc_trim``): what setting up and
    joining used once (the unpickled job's bytes, the pulled state) would otherwise stay
    resident under a threshold that never trims. The steps then keep only their own."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
