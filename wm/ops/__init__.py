"""Operations: a node's health over HTTP. Registered by name (``wm.celeryapp`` adds the
server to a node, ``wm health`` loads its client); nothing else imports this package."""
