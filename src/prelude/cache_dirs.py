"""Where Prelude keeps what it makes once per machine (converted models, prepared weights,
built kernels, measured routes, batch jobs): one root, PRELUDE_CACHE_DIR or the XDG cache.
A leaf module, so the kernels below the model layer can find their cache."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("PRELUDE_CACHE_DIR"):
        return Path(os.environ["PRELUDE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prelude"
