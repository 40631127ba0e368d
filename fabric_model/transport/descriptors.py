"""Descriptors enough for many connections (docs/architecture.md, "Scale", "The collective group").

The driver holds two connections a worker (control and store), and a gloo rank one socket a
peer: past about 500 workers, or a group of about 1,000 ranks, the common soft limit of 1,024
open descriptors runs out. A process that may hold that many raises its soft limit to the hard
one, as a server would; nothing here ever lowers it. The package waits on descriptors with
``selectors`` (epoll or poll), never ``select.select``, which cannot see descriptors past 1,023.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def allow_many_descriptors() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a container that forbids it: the old limit stands
        log.debug("could not raise the open-descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard
