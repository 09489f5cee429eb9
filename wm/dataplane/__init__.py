"""One event's path through Celery: queue names and the app factory (``queues``, ``app``),
publishing (``bus``, ``outputs``), the consumer task and its failure policy (``tasks``,
``delivery``), dead letters, the lifecycle outbox, and the hooks of a node (``node``)."""
