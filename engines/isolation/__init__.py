"""Isolation mode shared by the engines that otherwise run foreign code inside the Celery
process (native over cffi, .NET over pythonnet): the worker's code runs in a helper process
instead, so a crash or a hang costs one failed delivery, not the node.

Modules: ``host`` (the host side: a :class:`~engines.isolation.host.HelperProcess` that
starts, calls, times out and restarts a helper), ``helper`` (the helper side: process setup,
the :class:`~engines.isolation.helper.Host` at the other end of the pipes, the serve loop).
The process, its pipes and the frames they carry are :mod:`engines.childproc`, which the
Python sandbox uses too. An engine supplies only what is its own: the helper's module, what
it loads, and how its refusals map to exceptions.

This package imports nothing but the standard library, :mod:`engines.childproc` and
:mod:`wm.errors`: an engine's heavy dependency (cffi, pythonnet) stays in that engine's
package, and in its helper process.
"""
