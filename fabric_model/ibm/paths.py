"""Where IBM's logging modules write: one rule shared by ``emetrics`` (zipped) and our ``elog`` (fallback)."""

from __future__ import annotations

import os

from ..settings.registry import JOB_STATE_DIR, LOG_DIR, RESULT_DIR


def log_folder() -> str:
    """``$LOG_DIR``, else ``$JOB_STATE_DIR/logs`` (where IBM's runtime put logs before
    ``LOG_DIR``), else ``$RESULT_DIR/logs``."""
    log_dir, job_state_dir = LOG_DIR.get(), JOB_STATE_DIR.get()
    if log_dir:
        return log_dir
    if job_state_dir:
        return os.path.join(job_state_dir, "logs")
    return os.path.join(RESULT_DIR.get() or ".", "logs")
