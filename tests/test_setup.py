"""The Makefile's setup: a disk too full for the environment is refused before anything is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_setup_on_a_disk_too_full_says_so_before_installing(tmp_path):
    """`make setup` where the disk has less free than DISK_NEEDED_MB: exit 2 with the space needed, the space free and
    the fix, and no environment created (pip would fail part-way with "No space left on device")."""
    for f in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / f, tmp_path / f)
    free_mb = shutil.disk_usage(tmp_path).free >> 20
    p = subprocess.run(["make", "setup", f"DISK_NEEDED_MB={free_mb + 100_000}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"needs about {free_mb + 100_000} MB free" in p.stderr and "fix: free some space" in p.stderr, p.stderr
    assert not (tmp_path / ".venv").exists()
