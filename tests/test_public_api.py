"""The public API is what ``wm.__all__`` says, and every name in it resolves."""

from __future__ import annotations

import subprocess
import sys

import wm


def test_all_names_resolve() -> None:
    for name in wm.__all__:
        assert getattr(wm, name) is not None, name
    assert sorted(wm.__all__) == wm.__all__


def test_engines_import_without_the_control_plane_first() -> None:
    code = "import engines.python, sys; assert 'wm.manager' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_admin_script_builds_no_node() -> None:
    """Publishing from a script loads neither the ``celery -A`` entry point nor the consumer."""
    code = (
        "import sys; from wm import WorkManager; import wm.dataplane.bus; "
        "node = {'wm.celeryapp', 'wm.dataplane.tasks', 'wm.dataplane.node'} & set(sys.modules); "
        "assert not node, node"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
