"""The helper process of an isolated native worker: ``python -m engines.native.helper``.

The process around it (frames, die-with-parent, no core dumps, the serve loop) is
:mod:`engines.isolation.helper`; what is native is only the loading: the library the host
sends becomes a :class:`engines.native.library.NativeLibrary`, whose ``call`` is the whole
ABI round trip (and whose ``probe`` runs the optional Probe export) and whose worker's log
and gateway calls go to the host. Its failures keep their return code (NativeCallFailed)
across the pipe.
"""

from __future__ import annotations

import sys
from typing import Any

from engines.isolation.helper import Host, run
from engines.native.library import NativeLibrary


def load(spec: dict[str, Any], image: bytes, host: Host) -> NativeLibrary:
    """The library ``image`` as the host's spec (engines.native.isolated) describes it."""
    return NativeLibrary(
        image,
        spec["file_name"],
        spec["entry_point"],
        spec["free_result"],
        host.log,
        host.gateway,
        spec["probe"],
        spec["max_output_bytes"],
    )


if __name__ == "__main__":
    sys.exit(run(load))
