"""Celery settings for ``celery -A wm.celeryapp``, derived from the environment via wm.config."""

from wm.celeryapp import celery_settings
from wm.config import Settings

globals().update(celery_settings(Settings.from_env()))
