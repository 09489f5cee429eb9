"""The native ABI as Python declares it, read from the C header itself: the one declaration
of the ABI is ``native_abi/virtufin_worker_api.h``, which this package ships as a link to it
(``virtufin_worker_api.h`` beside this module, package data), and nothing here restates a
struct field, a prototype or a constant.

cffi parses plain C declarations, not the preprocessor: :func:`parse` drops comments, the
C++ ``extern "C"`` wrapper and every directive, keeps the integer ``#define``\\ s as
:attr:`Abi.constants`, the typedefs as :attr:`Abi.types` and each export's prototype by its
header name in :attr:`Abi.prototypes`. ``tests/test_native_abi.py`` checks what cffi makes
of them against what a C compiler makes of the header: every field's offset and size, each
prototype, each constant.

Only the standard library is used, so this reads without cffi installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The header, as shipped with this package (a link to the kit's).
HEADER_FILE = Path(__file__).with_name("virtufin_worker_api.h")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(-?\d+)[ \t]*$", re.MULTILINE)
_CPLUSPLUS = re.compile(
    r"^[ \t]*#[ \t]*ifdef[ \t]+__cplusplus\b.*?^[ \t]*#[ \t]*endif[^\n]*$",
    re.DOTALL | re.MULTILINE,
)
_DIRECTIVE = re.compile(r"^[ \t]*#[^\n]*$", re.MULTILINE)
_TYPEDEF = re.compile(r"typedef\b[^;{]*(?:\{.*?\})?[^;]*;", re.DOTALL)
_FUNCTION_NAME = re.compile(r"(\w+)\s*\(")


@dataclass(frozen=True)
class Abi:
    """The declarations of the header, as cffi takes them."""

    #: The typedefs (the VirtufinHost struct), for ``FFI.cdef``.
    types: str
    #: Each export's prototype by its name in the header (Process, FreeResult, Probe).
    prototypes: dict[str, str]
    #: Every integer ``#define``: name -> value.
    constants: dict[str, int]

    def prototype(self, export: str, name: str) -> str:
        """The header's prototype of ``export`` declared as ``name`` (manifest.json may
        rename an export)."""
        declaration = self.prototypes[export]
        pattern = rf"\b{re.escape(export)}(?=\s*\()"
        return re.sub(pattern, lambda _: name, declaration, count=1)


def parse(text: str) -> Abi:
    """The declarations of a header such as ``virtufin_worker_api.h``."""
    code = _COMMENT.sub(" ", text)
    constants = {name: int(value) for name, value in _DEFINE.findall(code)}
    code = _DIRECTIVE.sub("", _CPLUSPLUS.sub("", code))
    types = ["\n".join(map(str.rstrip, m.group(0).splitlines())) for m in _TYPEDEF.finditer(code)]
    prototypes: dict[str, str] = {}
    for statement in _TYPEDEF.sub("", code).split(";"):
        statement = " ".join(statement.split())
        found = _FUNCTION_NAME.search(statement)
        if found is not None:
            prototypes[found.group(1)] = statement + ";"
    return Abi("\n".join(types), prototypes, constants)


#: The ABI of this package's header.
ABI = parse(HEADER_FILE.read_text(encoding="utf-8"))
#: The ABI version the header declares (VirtufinHost.abi_version, manifest.json's abi_version).
ABI_VERSION = ABI.constants["VIRTUFIN_ABI_VERSION"]
