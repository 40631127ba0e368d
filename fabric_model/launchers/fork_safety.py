"""Whether the caller may be forked into the job's warm process (docs/architecture.md, "Start-up").

A fork keeps one thread: a library whose threads existed in the parent finds them gone in the
child. Most libraries cope (OpenBLAS shuts its pool down around a fork); GNU libgomp does not:
once torch has run a parallel operation, a fork hangs in its first one. CUDA contexts and
TensorFlow's runtime break under a fork too. So the caller is forked only while it has no
thread but its main one, OpenBLAS's pool and the idle threads of libraries known to handle a
fork themselves (``FORK_SAFE_THREADS``: jemalloc's), no CUDA context and no TensorFlow; anything
else, or anything this module cannot read, starts a fresh interpreter instead. (The warm
process still checks OpenMP itself before it serves: :func:`fabric_model.launchers.warm.from_fork`.)
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

#: The names under which OpenBLAS builds export ``get_num_threads`` (numpy's wheels: scipy_openblas).
_OPENBLAS_THREADS = (
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
)


#: The caller's blocker a warm process that imported TensorFlow itself does not have (below).
TENSORFLOW_LOADED = "TensorFlow is loaded"


def fork_blockers() -> list[str]:
    """Why this process must not be forked now; empty when it may be."""
    if not sys.platform.startswith("linux"):
        return [f"{sys.platform} is not Linux"]
    blockers = []
    if threading.active_count() > 1 or threading.current_thread() is not threading.main_thread():
        blockers.append(f"{threading.active_count()} Python threads")
    if "tensorflow" in sys.modules:
        blockers.append(TENSORFLOW_LOADED)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        blockers.append("CUDA is initialized")
    blockers += _native_thread_blockers()
    return blockers


def blockers_after_imports() -> list[str]:
    """Why the warm process, its imports done, must not fork its workers: :func:`fork_blockers`
    but for TensorFlow being loaded. Imported, TensorFlow has no thread and nothing a fork breaks:
    its runtime (thread pools, devices) starts with its first operation, which only a worker runs;
    the caller's TensorFlow has run operations (it built the model). Had an import started the
    runtime, or any thread of its own, its threads would be named here (docs/architecture.md,
    "Start-up")."""
    return [reason for reason in fork_blockers() if reason != TENSORFLOW_LOADED]


#: The futex system call's number, by machine: an idle pool thread waits in it.
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}

#: Library threads that a fork leaves safely behind, by the name their library gives them, while
#: they wait idle: each library stops and restarts them around a fork itself (pthread_atfork).
FORK_SAFE_THREADS = {
    # jemalloc's background purging thread: pyarrow's allocator, so any script that imported
    # pyarrow, `datasets` or pandas with pyarrow has one. Its prefork and postfork handlers stop
    # it and start it again on demand in the child.
    "jemalloc_bg_thd": "jemalloc's background thread (pyarrow's allocator)",
}


def _native_thread_blockers() -> list[str]:
    """Threads other than the main one and OpenBLAS's pool: each is a reason not to fork.

    A thread is OpenBLAS's when it waits on a futex inside an OpenBLAS library's memory (its
    pool's condition variables are the library's own statics): counting the pool from
    ``get_num_threads`` alone falls short where the count was lowered after the pool started
    (docs/architecture.md, "Start-up"). Threads not known so count against what the pools' counts
    leave beyond those known: a thread of another library never passes for OpenBLAS's."""
    libraries = _mapped_libraries()
    futex = _FUTEX.get(os.uname().machine)
    others, known = [], 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:
            return [f"thread {tid} cannot be inspected"]
        if len(fields) < 3:  # running: whose it is cannot be told (OpenMP's spin a while after work)
            return [f"thread {tid} is running"]
        library = _library_at(libraries, int(fields[-1], 16))
        if "libgomp" in library:
            return ["OpenMP's threads have started (torch ran a parallel operation)"]
        if futex is not None and len(fields) > 3 and fields[0] == str(futex):
            owner = _owner_of(libraries, int(fields[1], 16))
            if "openblas" in os.path.basename(owner).lower():
                known += 1  # OpenBLAS stops its pool around a fork (pthread_atfork)
                continue
            if _name_of(tid) in FORK_SAFE_THREADS:  # idle, and its library handles a fork itself
                continue
        others.append(f"thread {tid} waits in {os.path.basename(library) or 'unknown code'}")
    pool = max(0, _openblas_pool_threads(libraries) - known)  # what its count allows besides those known
    if len(others) > pool:
        return [f"{len(others)} native threads, {pool} of them OpenBLAS's: " + "; ".join(others)]
    return []


def _name_of(tid: str) -> str:
    """The name a thread was given (``pthread_setname_np``), or "" where it cannot be read."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _mapped_libraries() -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of this process, in address order; ``""`` for
    anonymous memory."""
    mapped = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else ""
            mapped.append((start, end, path))
    return mapped


def _owner_of(libraries: list[tuple[int, int, str]], address: int) -> str:
    """The file whose image holds ``address``: its own mapping, or the anonymous one right after
    it (a library's zero-initialised statics, ``.bss``)."""
    for i, (start, end, path) in enumerate(libraries):
        if start <= address < end:
            if path or i == 0:
                return path
            before = libraries[i - 1]
            return before[2] if before[1] == start else ""
    return ""


def _library_at(libraries: list[tuple[int, int, str]], address: int) -> str:
    return next((path for start, end, path in libraries if start <= address < end), "")


def _openblas_pool_threads(libraries: list[tuple[int, int, str]]) -> int:
    """The threads of every loaded OpenBLAS's pool (it starts ``n - 1`` of them at load)."""
    threads = 0
    for path in sorted({path for _, _, path in libraries if "openblas" in os.path.basename(path).lower()}):
        try:
            library = ctypes.CDLL(path)  # already loaded: the same handle
        except OSError:
            continue
        for name in _OPENBLAS_THREADS:
            if hasattr(library, name):
                threads += max(0, int(getattr(library, name)()) - 1)
                break
    return threads
