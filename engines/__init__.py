"""Engines run worker code: plugins only. Each is registered for a MIME type in the
``wm.engines`` entry-point group (the contract and the registry are :mod:`wm.engine`), so a
new engine needs no change to the core, and the core never imports this package."""
