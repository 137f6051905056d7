"""The commit a benchmark's results name: FUSEDLOSS_COMMIT where the tree is no git checkout (a
GPU machine's copy), else git's short hash, else "unknown"."""
import os
import subprocess


def git_commit() -> str:
    if os.environ.get("FUSEDLOSS_COMMIT"):
        return os.environ["FUSEDLOSS_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"
