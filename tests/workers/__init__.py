"""Example Python workers, loaded as code by the engine tests and imported by DevKit tests."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def code(name: str, **replacements: object) -> bytes:
    """The source of ``<name>.py``, with ``KEY = default`` lines replaced by ``KEY = value``."""
    text = (HERE / f"{name}.py").read_text(encoding="utf-8")
    for key, value in replacements.items():
        lines = [line for line in text.splitlines() if line.startswith(f"{key} = ")]
        assert len(lines) == 1, f"{name}.py has no single {key} line"
        text = text.replace(lines[0], f"{key} = {value!r}")
    return text.encode("utf-8")


def child_pids() -> set[int]:
    """Processes whose parent is the current process (to prove none is left behind)."""
    import os

    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(entry))
    return found
