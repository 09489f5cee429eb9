"""Redis: derived state that recovery can rebuild from PostgreSQL. The connection and its
error translation (``connection``), group locks with fences (``locks``), recorded outcomes
(``outcomes``), the pending-delivery ledger (``ledger``) and the routing cache of worker
facts (``directory``). WM_REDIS_URL may be a single server or a Redis Cluster: every key is
hash-tagged so that each script touches one slot (``connection`` says more)."""
