"""One loaded native worker library and calls into it, over cffi in ABI mode (no compiler).

The library is copied to a fresh temporary file and opened from there, so each load is a new
instance (a reload never reuses the old code's globals) and the worker's bytes never have to
be on disk under a guessable name. ``call`` is the whole ABI round trip: Process, checks of
the answer, a copy of it, and FreeResult exactly once whenever Process handed out a buffer,
on every path. ``probe`` calls the optional Probe export, the worker's health probe.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from cffi import FFI, CDefError

from engines.native.abi import ABI, ABI_VERSION
from wm.errors import InvalidCode, OutputTooLarge, WorkerExecutionError

logger = logging.getLogger(__name__)

#: Largest answer accepted from Process unless the node's WM_MAX_OUTPUT_BYTES says otherwise.
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
_CODES = ABI.constants
#: Return codes of Process and Probe, by name (virtufin_worker_api.h).
RETURN_CODES = {
    value: name
    for name, value in _CODES.items()
    if name == "VIRTUFIN_OK" or name.startswith("VIRTUFIN_ERR_")
}
GATEWAY_OK, GATEWAY_FAILED, GATEWAY_BAD_REQUEST = (
    _CODES["VIRTUFIN_GATEWAY_" + name] for name in ("OK", "FAILED", "BAD_REQUEST")
)
#: Python logging levels of the ABI's levels (trace is below DEBUG).
TRACE = 5
LOG_LEVELS = {
    _CODES["VIRTUFIN_LOG_TRACE"]: TRACE,
    _CODES["VIRTUFIN_LOG_DEBUG"]: logging.DEBUG,
    _CODES["VIRTUFIN_LOG_INFO"]: logging.INFO,
    _CODES["VIRTUFIN_LOG_WARN"]: logging.WARNING,
    _CODES["VIRTUFIN_LOG_ERROR"]: logging.ERROR,
}

#: ``log(level, message)`` as Python sees it.
LogSink = Callable[[int, str], None]
#: ``gateway(service, method, request) -> (return code, response JSON bytes)``.
GatewaySink = Callable[[str, str, bytes], tuple[int, bytes]]

#: The ABI's types (the VirtufinHost struct), declared from the header.
ffi = FFI()
ffi.cdef(ABI.types)
#: The C library's allocator: gateway responses are malloc'ed and released by free_response.
_libc_ffi = FFI()
_libc_ffi.cdef("void* malloc(size_t size); void free(void* ptr);")
_libc: Any = _libc_ffi.dlopen(None)


class NativeCallFailed(WorkerExecutionError):
    """Raised when Process returns a non-zero code: a failed delivery (retried, then parked);
    or when Probe does: a failed health probe."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class NativeOutputRefused(WorkerExecutionError):
    """Raised when Process's answer is unusable (no buffer, a bad length, not a valid
    WorkerResponse): the same code would answer the same again, so it is parked at once."""

    retryable = False


def code_name(code: int) -> str:
    return f"{code} ({RETURN_CODES[code]})" if code in RETURN_CODES else str(code)


class NativeLibrary:
    """A worker library loaded from ``image`` (its bytes) with its two exports resolved, and
    its optional ``probe`` export when it has one.

    ``log`` and ``gateway`` receive the worker's host callbacks; they may be called from any
    thread that runs Process, and must not raise (an exception is logged and answered with a
    failure code). ``log`` is called for the levels ``logs`` accepts (by default all): a
    message nobody keeps is not read from the library's memory.
    """

    def __init__(
        self,
        image: bytes,
        file_name: str,
        entry_point: str,
        free_result: str,
        log: LogSink,
        gateway: GatewaySink,
        probe: str | None = None,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        logs: Callable[[int], bool] = lambda _level: True,
    ) -> None:
        self.file_name = file_name
        self.max_output_bytes = max_output_bytes
        self._log, self._logs, self._gateway = log, logs, gateway
        self._responses: set[int] = set()
        self._responses_lock = threading.Lock()
        #: Per thread, Process's out-parameters, allocated once (a call cannot nest).
        self._slots = threading.local()
        self._ffi = FFI()
        self._ffi.include(ffi)
        self._probe: Any = None
        self._host: Any = None
        self._handle: Any = None
        self._callbacks: tuple[Any, ...] = ()
        _declare(self._ffi, entry_point, free_result, probe)
        #: Where the library was loaded from (the file is gone: only the mapping is left).
        self.path, self._lib = _open_copy(self._ffi, image, file_name)
        try:
            self._process = self._export(entry_point, "entry_point")
            self._free = self._export(free_result, "free_result")
            self._probe = None if probe is None else getattr(self._lib, probe, None)
            self._host = self._make_host()
        except BaseException:
            self.close()
            raise

    def declare(self, declarations: str) -> Any:
        """The library with more of its exports declared (C declarations), for tests and
        tools that read a worker's own diagnostics."""
        self._ffi.cdef(declarations, override=True)
        return self._lib

    def _export(self, name: str, key: str) -> Any:
        try:
            return getattr(self._lib, name)
        except AttributeError as exc:
            raise InvalidCode(
                f"the native library {self.file_name} does not export {name!r} "
                f"(manifest.json {key}): {exc}"
            ) from exc

    def _make_host(self) -> Any:
        self._handle = ffi.new_handle(self)
        self._callbacks = (
            ffi.callback("void(int32_t, const char*)", self._on_log),
            ffi.callback(
                "int32_t(const char*, const char*, const uint8_t*, int32_t, uint8_t**, int32_t*)",
                self._on_gateway,
                error=GATEWAY_FAILED,
            ),
            ffi.callback("void(uint8_t*)", self._on_free_response),
        )
        host = ffi.new("VirtufinHost*")
        host.engine_ptr = self._handle
        host.abi_version = ABI_VERSION
        host.log, host.gateway_call, host.free_response = self._callbacks
        return host

    def call(self, request: bytes) -> bytes:
        """Run Process on ``request`` (a CloudEvent FlatBuffer); its answer, copied."""
        slots = self._slots
        try:
            out_buf, out_len = slots.pair
        except AttributeError:  # this thread's first call: its two out-parameters
            out_buf, out_len = slots.pair = (ffi.new("uint8_t**"), ffi.new("int32_t*"))
        out_buf[0], out_len[0] = ffi.NULL, 0
        code = self._process(self._host, request, len(request), out_buf, out_len)
        buffer, length = out_buf[0], out_len[0]
        if buffer == ffi.NULL:
            if code:
                raise NativeCallFailed(code, f"Process returned {code_name(code)}")
            raise NativeOutputRefused("Process returned 0 (VIRTUFIN_OK) but no output buffer")
        try:
            if code:
                raise NativeCallFailed(code, f"Process returned {code_name(code)}")
            if length > self.max_output_bytes:  # refused before it is copied
                raise OutputTooLarge(
                    f"Process returned an output length of {length} bytes, over "
                    f"WM_MAX_OUTPUT_BYTES ({self.max_output_bytes})"
                )
            if length <= 0:
                raise NativeOutputRefused(
                    f"Process returned an output length of {length} bytes; expected 1 or more"
                )
            return bytes(ffi.buffer(buffer, length))
        finally:
            self._free(buffer)

    def probe(self) -> bool | None:
        """Run Probe: True when it returned VIRTUFIN_OK, None when the library does not export
        it; any other code is raised as NativeCallFailed, the failed probe's reason."""
        if self._probe is None:
            return None
        code = self._probe(self._host)
        if code:
            raise NativeCallFailed(code, f"Probe returned {code_name(code)}")
        return True

    def close(self) -> None:
        """Unload the library. Safe to call more than once."""
        lib, self._lib = self._lib, None
        if lib is not None:
            self._ffi.dlclose(lib)
        # the host struct, its callbacks and the engine handle die with the library
        self._host = self._handle = None
        self._callbacks = ()

    # -- host callbacks (called from native code: must never raise) --------------------------

    def _on_log(self, level: int, message: Any) -> None:
        try:
            if self._logs(level := LOG_LEVELS.get(level, logging.ERROR)):
                text = ffi.string(message).decode("utf-8", "replace") if message else ""
                self._log(level, text)
        except Exception:
            logger.exception("native worker log callback failed")

    def _on_gateway(
        self,
        service: Any,
        method: Any,
        request: Any,
        request_len: int,
        response: Any,
        response_len: Any,
    ) -> int:
        if response == ffi.NULL or response_len == ffi.NULL:
            return GATEWAY_BAD_REQUEST
        response[0], response_len[0] = ffi.NULL, 0
        try:
            if (
                service == ffi.NULL
                or method == ffi.NULL
                or request_len < 0
                or (request == ffi.NULL and request_len > 0)
            ):
                code, answer = GATEWAY_BAD_REQUEST, b'{"error": "gateway_call arguments"}'
            else:
                body = bytes(ffi.buffer(request, request_len)) if request_len else b""
                code, answer = self._gateway(
                    ffi.string(service).decode("utf-8", "replace"),
                    ffi.string(method).decode("utf-8", "replace"),
                    body,
                )
        except Exception as exc:
            logger.exception("native worker gateway callback failed")
            code, answer = GATEWAY_FAILED, error_json(f"gateway call failed in the host: {exc}")
        memory = _libc.malloc(max(1, len(answer)))
        if memory == ffi.NULL:
            return GATEWAY_FAILED
        ffi.memmove(memory, answer, len(answer))
        with self._responses_lock:
            self._responses.add(int(ffi.cast("uintptr_t", memory)))
        response[0], response_len[0] = ffi.cast("uint8_t*", memory), len(answer)
        return code

    def _on_free_response(self, response: Any) -> None:
        if response == ffi.NULL:
            return
        address = int(ffi.cast("uintptr_t", response))
        with self._responses_lock:
            known = address in self._responses
            self._responses.discard(address)
        if known:
            _libc.free(response)
        else:
            self._log(logging.ERROR, f"free_response({address:#x}): not a response of this host")


def _declare(local: FFI, entry_point: str, free_result: str, probe: str | None) -> None:
    if entry_point == free_result:
        raise InvalidCode(
            f"manifest.json names {entry_point!r} as both entry_point and free_result"
        )
    if probe in (entry_point, free_result):
        raise InvalidCode(f"manifest.json names {probe!r} as probe and as another export")
    exports = {"Process": entry_point, "FreeResult": free_result}
    if probe is not None:
        exports["Probe"] = probe
    declarations = "\n".join(ABI.prototype(export, name) for export, name in exports.items())
    try:
        local.cdef(declarations)
    except CDefError as exc:
        raise InvalidCode(f"manifest.json export names cannot be declared: {exc}") from exc


def _open_copy(local: FFI, image: bytes, file_name: str) -> tuple[str, Any]:
    """``image`` loaded from a fresh file, which is gone on return: the mapping outlives it,
    so nothing is left on disk, even if the process dies. The file's path and the library."""
    fd, path = tempfile.mkstemp(prefix="wm-native-", suffix="-" + file_name)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(image)
        os.chmod(path, 0o500)
        return path, _open(local, path, file_name)
    finally:
        os.unlink(path)


def _open(local: FFI, path: str, file_name: str) -> Any:
    try:
        return local.dlopen(path)
    except OSError as exc:
        hint = ""
        if "map segment" in str(exc):
            hint = (
                f" (libraries are copied to {os.path.dirname(path)} to be loaded: if it is "
                "mounted noexec, point TMPDIR at a folder that is not)"
            )
        raise InvalidCode(f"the native library {file_name} cannot be loaded: {exc}{hint}") from exc


def error_json(message: str) -> bytes:
    """A gateway answer carrying an error: ``{"error": message}``."""
    return json.dumps({"error": message}).encode()
