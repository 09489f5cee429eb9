"""Calls Process of library argv[2] on each input of the JSON file argv[3] (hex strings) and
prints the codes; argv[1] is the cdef. Each input is passed twice: right after a PROT_NONE
page, then right before one, so reading outside it is a segfault (run by test_native_abi)."""

import json
import mmap
import sys

import cffi

ffi = cffi.FFI()
ffi.cdef(sys.argv[1])
ffi.cdef("int mprotect(void *addr, size_t len, int prot);")
libc, lib = ffi.dlopen(None), ffi.dlopen(sys.argv[2])
with open(sys.argv[3]) as f:
    cases = [bytes.fromhex(case) for case in json.load(f)]
page = mmap.PAGESIZE
area = mmap.mmap(-1, 3 * page)
base = ffi.cast("uint8_t *", ffi.from_buffer(area))
assert libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + 2 * page, page, 0) == 0
log = ffi.callback("void(int32_t, const char *)", lambda level, message: None)
host = ffi.new("VirtufinHost *", {"abi_version": 1, "log": log})
out, out_len = ffi.new("uint8_t **"), ffi.new("int32_t *")
codes = []
for case in cases:
    for start in (page, 2 * page - len(case)):
        area[start : start + len(case)] = case
        codes.append(lib.Process(host, base + start, len(case), out, out_len))
        if out[0] != ffi.NULL:
            lib.FreeResult(out[0])
print(json.dumps(codes))
