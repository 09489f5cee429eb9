"""The child processes of the engines: the Python sandbox, and the helper process of a native
or .NET worker run in isolation. One frame protocol and one host for all of them.

Modules: ``frames`` (the frames, their kinds and the encodings both sides share, and the
child's end of the pipes: :class:`~engines.childproc.frames.Channel`), ``host`` (the host's
end: :class:`~engines.childproc.host.ChildProcess`, which starts a child with the pipes,
exchanges frames with it under a deadline, serves its log and gateway frames, and kills and
reaps it). What a call's payload holds, how a child is set up, restarted and described in
messages is each engine's.

Only the standard library and :mod:`wm.errors` are imported here, and ``frames`` uses the
standard library alone: the sandboxed child imports it before anything of the platform.
"""
