"""The control plane behind the :class:`~wm.manager.WorkManager` facade, one module per part:
``workers`` (finding workers and reading their records), ``lifecycle`` (create, start, stop,
delete), ``versions`` (code updates, rollback, history), ``schedules``, ``subscriptions``,
``deadletters`` (list, replay, purge), ``access`` (API tokens and the audit log) and the
status read models ``overview`` and ``workerdetails``; ``context`` is what they share (the
settings, who asks, the bus). The SQL they run lives in ``wm.store``.

``workers``, ``versions``, ``schedules`` and ``access`` import no data plane (``context``
loads it on first use), so a command that only reads loads neither Celery nor kombu.
"""
