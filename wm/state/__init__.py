"""Redis: derived state that recovery can rebuild from PostgreSQL. The connection and its
error translation (``connection``), group locks with fences (``locks``), recorded outcomes
(``outcomes``), the pending-delivery ledger (``ledger``) and the routing cache of worker
facts (``directory``)."""
