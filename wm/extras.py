"""How to install one of the package's extras, as the copy that runs was installed.

``pip install 'workmanager[native]'`` fetches the package from PyPI: in a clone (an
editable install, or the sources on the path) it installs a second copy beside the one that
runs, or fails when the index has none. From a source checkout the hint names the checkout.
"""

from __future__ import annotations

from pathlib import Path

#: The folder holding the ``wm`` package: a source checkout's root when it holds
#: ``pyproject.toml`` (an installed wheel puts none beside the package).
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def source_checkout() -> Path | None:
    """The root of the source checkout ``wm`` runs from, or None for an installed wheel."""
    return PACKAGE_PARENT if (PACKAGE_PARENT / "pyproject.toml").is_file() else None


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra`` into the environment that runs."""
    root = source_checkout()
    if root is None:
        return f"pip install 'workmanager[{extra}]'"
    where = "." if Path.cwd().resolve() == root else str(root)
    return f"pip install -e '{where}[{extra}]'"
