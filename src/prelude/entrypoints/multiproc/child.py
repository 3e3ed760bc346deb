"""What every child of the `--api-server-count` supervisor does first (its own module, so
that the engine and HTTP processes need not import the supervisor that starts them)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def child_setup(log_level: str, log_format: str) -> None:
    """First thing in every child: logging, its own process group, death with the parent."""
    from prelude.log_format import configure_logging

    configure_logging(log_level, log_format)
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: an orphan is left to its own devices
        pass
