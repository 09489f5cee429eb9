"""``python -m wm.cli`` runs the ``wm`` command."""

from wm.cli import main

raise SystemExit(main())
