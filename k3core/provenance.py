"""Which code produced a result: every report (bench/, conformance/) names the commit it measured."""
from __future__ import annotations

import os
import subprocess


def commit_under_test() -> str:
    """K3CORE_COMMIT when the caller sets it (the GPU scripts do: the device machine's copy of the tree can carry
    stale git metadata, so its own `git rev-parse` can name an older commit), else `git rev-parse HEAD` with
    '+dirty' when tracked files are edited, else 'unknown'."""
    if os.environ.get("K3CORE_COMMIT"):
        return os.environ["K3CORE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty else "")
