"""What a stage depended on (tasks/common/deps.py): the distributions of the packages it first imported."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_a_package_first_imported_while_recording_is_recorded_with_its_distribution_version():
    """In a fresh process (where yaml is not yet imported): importing it inside ``recording`` records PyYAML at its
    installed version; a package imported before the recording began is not the stage's."""
    code = """
import json, sys
from importlib import metadata
from tasks.common.deps import recording
assert "yaml" not in sys.modules and "colorsys" not in sys.modules
import colorsys  # before the recording: not the stage's
with recording() as rec:
    import yaml  # noqa: F401
    import colorsys  # noqa: F401,F811  (already imported)
print(json.dumps([rec.record()["libraries"], metadata.version("PyYAML")]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    import json

    libraries, version = json.loads(out.stdout)
    assert libraries == {"PyYAML": version}


def test_package_owners_is_read_once_per_state_of_the_installation(tmp_path, monkeypatch):
    """The package -> distribution map is kept while sys.path's folders are unchanged, and read again when a folder
    on it changes (a distribution installed into it) or the path itself does."""
    from tasks.common import deps

    first = deps.package_owners()
    assert first["yaml"] == ["PyYAML"]
    assert deps.package_owners() is first
    site = tmp_path / "site"
    (site / "newpkg").mkdir(parents=True)
    (site / "newpkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    assert deps.package_owners() is not first  # another path: read again
    again = deps.package_owners()
    assert deps.package_owners() is again
    dist = site / "newpkg-1.0.dist-info"  # a distribution installed into a folder on the path
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: newpkg\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("newpkg\n")
    st = site.stat()  # (file times tick by the kernel's coarse clock: a few ms apart may read the same)
    os.utime(site, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    owners = deps.package_owners()
    assert owners is not again and owners["newpkg"] == ["newpkg"]
