"""Celery settings for ``celery -A wm.celeryapp``, derived from the environment via wm.config."""

from wm.config import Settings
from wm.dataplane.app import celery_settings

globals().update(celery_settings(Settings.from_env()))
