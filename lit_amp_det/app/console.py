"""What reaches the console: the package's own lines. Third-party output a user cannot act on --
faster-coco-eval's per-evaluation tables, Lightning's advertising tips, deprecation warnings from inside
Lightning -- stays in the run's log file (``<command>.log``) or is silenced where it is raised;
``verbose=true`` shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings

from lit_amp_det.callbacks.console_log import emit
from lit_amp_det.checkpoint_io import DiskFull

__all__ = ["FILE_ONLY_LOGGERS", "SILENCED_WARNINGS", "USER_ERRORS", "quiet_console", "report_user_error"]

#: Loggers (name prefixes) whose records go to the log file only: faster-coco-eval logs a 26-line table per
#: evaluation, the ONNX exporter a line per graph rewrite.
FILE_ONLY_LOGGERS = ("faster_coco_eval", "onnx_ir", "onnxscript")
#: Record messages (prefixes) that go to the log file only.
FILE_ONLY_MESSAGES = ("💡 Tip",)
#: Warnings (message regexes) about library internals, silenced: nothing in the user's config causes or fixes
#: them.
SILENCED_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Precision \S+ is not supported by the model summary",
)


class _FileOnly(logging.Filter):
    """Drops, on a console handler, the records that belong in the log file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.name.startswith(FILE_ONLY_LOGGERS) or str(record.msg).startswith(FILE_ONLY_MESSAGES)
        )


def quiet_console(verbose: bool = False) -> None:
    """Keeps third-party chatter off the console (see the module) unless ``verbose``; the log file keeps all
    of it.
    """
    if verbose:
        return
    for pattern in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for handler in logging.getLogger().handlers:
        if (
            not isinstance(handler, logging.FileHandler)
            and isinstance(handler, logging.StreamHandler)
            and not any(isinstance(f, _FileOnly) for f in handler.filters)
        ):
            handler.addFilter(_FileOnly())


#: What a bad setting or file raises (the message says what to change): the console gets the message alone.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    DiskFull,
)


def report_user_error(err: BaseException, verbose: bool = False) -> bool:
    """For a :data:`USER_ERRORS` error (or one that wraps it): prints ``lit_amp_det: <message>`` to stderr,
    writes the traceback to the run's log file only, and returns True. False (the caller re-raises: a
    traceback) for any other error, with ``verbose``, or with ``HYDRA_FULL_ERROR=1``.
    """
    cause = err if isinstance(err, USER_ERRORS) else err.__cause__
    if not isinstance(cause, USER_ERRORS) or verbose or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return False
    emit("".join(traceback.format_exception(err)), console=False)  # the run's log file only
    print(f"lit_amp_det: {cause}", file=sys.stderr, flush=True)
    return True
