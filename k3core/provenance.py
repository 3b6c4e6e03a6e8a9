"""Which code produced a result: every report (bench/, conformance/) names the commit it measured, and the tuning
files that replaced a committed table in the run (`tuning_overrides`)."""
from __future__ import annotations

import json
import os
import subprocess

# Variables that make the kernels read a file in place of a committed table, so that a result measured under one
# is not the commit's alone: name -> what it replaces (kernels.triton.moe_mxfp4_tuned.TILES_ENV)
TUNING_VARIABLES = {"K3CORE_MXFP4_TILES": "MXFP4_TILES_NVIDIA (kernels/triton/moe_mxfp4_tiles.py)"}


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


def tuning_overrides() -> dict:
    """{"tuning_overrides": {variable: {"replaces", "path", "content"}}} for each tuning variable set in this
    process (the file's JSON, or why it could not be read), else {}: merged into a report's provenance."""
    found = {}
    for name, replaces in TUNING_VARIABLES.items():
        path = os.environ.get(name)
        if not path:
            continue
        try:
            with open(path) as handle:
                content = json.load(handle)
        except (OSError, ValueError) as exc:
            content = f"unreadable: {type(exc).__name__}: {exc}"
        found[name] = {"replaces": replaces, "path": path, "content": content}
    return {"tuning_overrides": found} if found else {}
