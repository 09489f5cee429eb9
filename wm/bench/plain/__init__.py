"""The drain's reference: a plain Celery app (``plaincelery``) that ``wm bench`` runs as its
own ``celery worker`` process tree, with this folder alone on its import path. Nothing in it
imports WorkManager; nothing in WorkManager imports it."""
