"""Attacker-mode probe (run by tests/test_sandbox_kernel_only.py, possibly as another user).

Loads a worker with the import guard, restricted builtins and audit hook switched **off**
(the runner's test-only init key) and ``os``, ``ctypes``, ``socket``, ``subprocess``
importable, runs escape probes in it and prints ``{"layers": [...], "probes": {...}}``.
Usage: python kernel_only_probe.py HOST_PID LISTENING_PORT UNUSED_PORT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import wm  # noqa: F401 - the platform before engines
from engines.python.engine import PythonEngine
from engines.python.runner import TEST_ONLY_KERNEL_LAYERS_ALONE
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.events import make_event

PROBES = r"""
import ctypes, os, socket, subprocess
from wm.devkit import make_event

HOST_PID, PORT, UNUSED = %d, %d, %d
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def attempt(action):
    try:
        result = action()
    except BaseException as exc:
        return "blocked: " + type(exc).__name__ + ": " + str(exc)[:120]
    return "ESCAPED: " + repr(result)[:200]


def raw(number, *args):
    def call():
        result = libc.syscall(number, *args)
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return result
    return call


def read(path):
    return lambda: open(path, 'rb').read(64)


def connect(port):
    return lambda: socket.create_connection(('127.0.0.1', port), timeout=2)


def write(path):
    def call():
        with open(path, 'w') as handle:
            handle.write('pwned')
        return path
    return call


def process(event):
    probes = {
        'read /etc/shadow': read('/etc/shadow'),
        'read /etc/passwd': read('/etc/passwd'),
        'read host /proc/1/environ': read('/proc/1/environ'),
        'list /proc': lambda: os.listdir('/proc'),
        'list /etc': lambda: os.listdir('/etc'),
        'read the host test file': read(os.path.abspath(%r)),
        'tcp to the host listener': connect(PORT),
        'tcp to an unused port': connect(UNUSED),
        'signal the host test process': lambda: os.kill(HOST_PID, 0),
        'write /tmp': write('/tmp/wm-kernel-only-pwned'),
        'write /': write('/wm-kernel-only-pwned'),
        'write beside the code': write(os.path.dirname(os.__file__) + '/pwned.py'),
        'run /bin/sh': lambda: subprocess.run(['/bin/sh', '-c', 'id'], capture_output=True),
        'raw socket(AF_INET)': raw(41, 2, 1, 0),
        'raw socket(AF_UNIX)': raw(41, 1, 1, 0),
        'raw ptrace attach host': raw(101, 16, HOST_PID, 0, 0),
        'raw mount tmpfs': raw(165, b'none', b'/', b'tmpfs', 0, 0),
        'raw unshare(user)': raw(272, 0x10000000),
        'raw keyctl': raw(250, 0, 0, 0, 0, 0),
        'raw bpf': raw(321, 0, 0, 0),
        'raw perf_event_open': raw(298, 0, 0, -1, -1, 0),
        'raw setns': raw(308, 0, 0),
    }
    results = {name: attempt(action) for name, action in probes.items()}
    results['control: write own directory'] = attempt(write('scratch.txt'))
    return make_event('probes', '/kernel-only', results)
"""


class KernelOnlyEngine(PythonEngine):
    """The engine with the in-process layers off: only the kernel layers stand."""

    def _launch_config(self, source: str, worker: WorkerSpec) -> dict[str, Any]:
        config = super()._launch_config(source, worker)
        config[TEST_ONLY_KERNEL_LAYERS_ALONE] = True
        return config


def main() -> None:
    host_pid, port, unused = (int(a) for a in sys.argv[1:4])
    settings = Settings(python_allowed_packages=("os", "ctypes", "socket", "subprocess"))
    engine = KernelOnlyEngine(settings)
    try:
        code = PROBES % (host_pid, port, unused, __file__)
        engine.load(code.encode(), WorkerSpec(worker_id="w-kernel-only", topic="probes"))
        [reply] = engine.process(make_event("probe", "/tests"), timeout_s=20)
        print(json.dumps({"layers": list(engine.isolation_layers), "probes": reply.get_data()}))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
