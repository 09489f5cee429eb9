"""``wm``'s read commands through the admin API (``WM_API_URL``, ``WM_API_TOKEN``).

A read command that reads the database, the broker and Redis itself spends most of its time
importing their clients (SQLAlchemy, psycopg and redis-py: 0.5-0.7 s of CPU on a 2-core
machine) before it sends one query. Through the API, which has them loaded, it imports the
views and the standard library's ``urllib.request`` (an HTTP client package such as httpx
costs 0.2 s to import by itself) and makes one or two GETs. The commands render what they
get exactly as they render what the :class:`wm.manager.WorkManager` returns: the API answers
with the views' own JSON, read back with :func:`wm.views.from_json`.

Through the API a command sees what the token may: its tenant's workers, letters, schedules
and status (a deployment-wide admin token: the tenant ``--tenant`` names), its tenant's
tokens and audit log (admins only).
"""

from __future__ import annotations

import builtins
import json
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlencode

from wm.config import Settings
from wm.errors import Conflict, NotFound, Refused, Unavailable, WorkManagerError
from wm.names import DEFAULT_TENANT, TENANT_HEADER
from wm.views import (
    AuditInfo,
    DeadLetterInfo,
    Overview,
    ScheduleInfo,
    SessionInfo,
    TenantInfo,
    TokenInfo,
    TransitionInfo,
    VersionInfo,
    WorkerDetails,
    WorkerInfo,
    field_errors,
    from_json,
)

if TYPE_CHECKING:
    from wm.control.access import Audit, Tokens
    from wm.control.deadletters import DeadLetters

#: Seconds a call may take before the command gives up on the API.
TIMEOUT_S = 30.0


class Reader(Protocol):
    """What the read commands ask: a :class:`wm.manager.WorkManager`, or :class:`ApiReader`."""

    @property
    def tenant(self) -> str: ...
    @property
    def dead_letters(self) -> DeadLetters | _Letters: ...
    @property
    def tokens(self) -> Tokens | _Tokens: ...
    @property
    def audit(self) -> Audit | _Audit: ...

    def list_workers(
        self, *, topic: str | None = None, group: str | None = None, status: str | None = None
    ) -> list[WorkerInfo]: ...
    def get_worker(self, worker_id: uuid.UUID | str, *, health: bool = True) -> WorkerInfo: ...
    def worker_details(self, worker_id: uuid.UUID | str) -> WorkerDetails: ...
    def worker_names(
        self, worker_ids: Iterable[uuid.UUID | str | None], *, all_tenants: bool = False
    ) -> dict[str, str | None]: ...
    def worker_id_of(self, reference: str, *, deleted_names: bool = False) -> str: ...
    def get_worker_history(self, worker_id: uuid.UUID | str) -> list[VersionInfo]: ...
    def get_worker_transitions(self, worker_id: uuid.UUID | str) -> list[TransitionInfo]: ...
    def get_code(self, worker_id: uuid.UUID | str, version: int | None = None) -> bytes: ...
    def session(self, worker_id: uuid.UUID | str, session: str) -> SessionInfo: ...
    def list_schedules(self, worker_id: uuid.UUID | str | None = None) -> list[ScheduleInfo]: ...
    def list_subscriptions(self, topic: str | None = None) -> list[dict[str, Any]]: ...
    def consume(
        self,
        topic: str,
        name: str,
        *,
        count: int | None = None,
        idle_s: float | None = None,
        peek: bool = False,
    ) -> Iterator[str | bytes]: ...
    def status(
        self, *, ping_timeout_s: float | None = None, own_tenant: bool = False
    ) -> Overview: ...


class ApiReader:
    """The read side of the facade, answered by the admin API at ``settings.api_url``."""

    def __init__(self, settings: Settings, tenant: str | None = None) -> None:
        self.url = settings.api_url
        self.token = settings.api_token
        #: The tenant named (``--tenant``, ``WM_TENANT``); a tenant's token works in its own.
        self.tenant = tenant or settings.tenant
        self.dead_letters = _Letters(self)
        self.tokens = _Tokens(self)
        self.audit = _Audit(self)

    # -- workers ---------------------------------------------------------------------------

    def list_workers(
        self, *, topic: str | None = None, group: str | None = None, status: str | None = None
    ) -> list[WorkerInfo]:
        found = self.get("/v1/workers", topic=topic, group=group, status=status)
        return [from_json(WorkerInfo, w) for w in found]

    def get_worker(self, worker_id: uuid.UUID | str, *, health: bool = True) -> WorkerInfo:
        return from_json(WorkerInfo, self.get(_worker_path(worker_id)))

    def worker_details(self, worker_id: uuid.UUID | str) -> WorkerDetails:
        return WorkerDetails.from_json(self.get(_worker_path(worker_id, "details")))

    def worker_names(
        self, worker_ids: Iterable[uuid.UUID | str | None], *, all_tenants: bool = False
    ) -> dict[str, str | None]:
        """The names the token's tenant has for ``worker_ids``: its live workers', then, for
        ids still missing, its deleted ones'."""
        wanted = {str(i) for i in worker_ids if i is not None}
        names: dict[str, str | None] = {}
        for status in (None, "deleted"):
            if wanted - names.keys():
                names.update((str(w.id), w.name) for w in self.list_workers(status=status))
        return {i: names[i] for i in wanted if i in names}

    def worker_id_of(self, reference: str, *, deleted_names: bool = False) -> str:
        """``reference`` as it is: the API resolves an id, a short id or a live name (not a
        deleted worker's name: its id, which the tables show, works)."""
        return reference

    def get_worker_history(self, worker_id: uuid.UUID | str) -> list[VersionInfo]:
        return [from_json(VersionInfo, v) for v in self.get(_worker_path(worker_id, "versions"))]

    def get_worker_transitions(self, worker_id: uuid.UUID | str) -> list[TransitionInfo]:
        found = self.get(_worker_path(worker_id, "transitions"))
        return [from_json(TransitionInfo, t) for t in found]

    def get_code(self, worker_id: uuid.UUID | str, version: int | None = None) -> bytes:
        return self.get_bytes(_worker_path(worker_id, "code"), version=version)

    def session(self, worker_id: uuid.UUID | str, session: str) -> SessionInfo:
        path = _worker_path(worker_id, "sessions", session)
        return from_json(SessionInfo, self.get(path))

    # -- schedules, subscriptions, the cluster ----------------------------------------------

    def list_schedules(self, worker_id: uuid.UUID | str | None = None) -> list[ScheduleInfo]:
        found = self.get("/v1/schedules", worker=worker_id)
        return [from_json(ScheduleInfo, s) for s in found]

    def list_subscriptions(self, topic: str | None = None) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get("/v1/subscriptions", topic=topic)
        return found

    def consume(
        self,
        topic: str,
        name: str,
        *,
        count: int | None = None,
        idle_s: float | None = None,
        peek: bool = False,
    ) -> Iterator[str | bytes]:
        """With ``peek`` only (the messages waiting, none taken; without a ``count`` as
        many as the API shows at once, 1,000): taking them is the command's own, on the
        broker."""
        if not peek:
            raise ValueError("through the API a subscription is only peeked at")
        path = f"/v1/subscriptions/{quote(topic, safe='')}/{quote(name, safe='')}/messages"
        found: list[str] = self.get(path, count=count)
        return iter(found)

    def list_tenants(self) -> list[TenantInfo]:
        return [from_json(TenantInfo, t) for t in self.get("/v1/tenants")]

    def revisions(self) -> tuple[str | None, str | None]:
        """The database's migration revision, and the newest of the API's code."""
        found = self.get("/v1/database")
        return found["current"], found["head"]

    def status(self, *, ping_timeout_s: float | None = None, own_tenant: bool = False) -> Overview:
        """The token's tenant's part of the cluster (the nodes are everyone's)."""
        return from_json(Overview, self.get("/v1/status"))

    # -- HTTP ------------------------------------------------------------------------------

    def get(self, path: str, **query: Any) -> Any:
        """The JSON a GET of ``path`` answers (None values left out of the query)."""
        return json.loads(self.get_bytes(path, **query))

    def get_bytes(self, path: str, **query: Any) -> bytes:
        import ssl
        import urllib.error
        import urllib.request

        given = {k: _query_value(v) for k, v in query.items() if v is not None}
        url = self.url + path + (f"?{urlencode(given)}" if given else "")
        headers = {"Accept": "application/json, application/octet-stream"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.tenant != DEFAULT_TENANT:
            headers[TENANT_HEADER] = self.tenant
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                body: bytes = answer.read()
                return body
        except urllib.error.HTTPError as exc:
            raise _refusal(exc.code, exc.read(), self.url) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise Unavailable(
                    f"the admin API at WM_API_URL={self.url} has a certificate this machine "
                    f"does not trust ({reason.verify_message}); for a private CA, point "
                    "SSL_CERT_FILE at its bundle"
                ) from None
            raise Unavailable(
                f"the admin API at WM_API_URL={self.url} does not answer ({reason}); start it "
                "(`wm api`) or unset WM_API_URL to read the database, broker and Redis directly"
            ) from None


class _Part:
    """A part of the facade (``dead_letters``, ``tokens``, ``audit``), through the API."""

    def __init__(self, reader: ApiReader) -> None:
        self.reader = reader


class _Letters(_Part):
    def list(
        self,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        include_replayed: bool = False,
        limit: int = 100,
    ) -> builtins.list[DeadLetterInfo]:
        found = self.reader.get(
            "/v1/deadletters",
            topic=topic,
            worker=worker_id,
            error_type=error_type,
            include_replayed=include_replayed or None,
            limit=limit,
        )
        return [from_json(DeadLetterInfo, {"envelope": "", **letter}) for letter in found]

    def get(self, letter_id: str) -> DeadLetterInfo:
        letter = self.reader.get(f"/v1/deadletters/{quote(letter_id, safe='')}")
        envelope = letter["envelope"]  # the event as JSON, or the text that is no JSON
        text = envelope if isinstance(envelope, str) else json.dumps(envelope)
        return from_json(DeadLetterInfo, {**letter, "envelope": text})


class _Tokens(_Part):
    def list(
        self, *, include_revoked: bool = False, own_tenant: bool = False
    ) -> builtins.list[TokenInfo]:
        found = self.reader.get("/v1/tokens", include_revoked=include_revoked or None)
        return [from_json(TokenInfo, t) for t in found]


class _Audit(_Part):
    def list(
        self,
        *,
        token: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        tenant: str | None = None,
    ) -> builtins.list[AuditInfo]:
        found = self.reader.get("/v1/audit", token=token, since=since, limit=limit)
        return [from_json(AuditInfo, e) for e in found]


def _worker_path(worker_id: uuid.UUID | str, *rest: str) -> str:
    return "/".join(["/v1/workers", *(quote(str(p), safe="") for p in (worker_id, *rest))])


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _refusal(code: int, body: bytes, url: str) -> WorkManagerError:
    """The API's error answer as the error the command would have met itself (its group,
    so the exit code and the one-line message are the same)."""
    try:
        detail: Any = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        detail = body.decode("utf-8", "replace").strip()
    if isinstance(detail, list):  # a 422: each field that was refused, and why
        detail = field_errors(detail)
    text = str(detail or f"HTTP {code}")
    if code in (401, 403):
        return Refused(f"the admin API at WM_API_URL={url} refused the call: {text} (WM_API_TOKEN)")
    kind: type[WorkManagerError] = {404: NotFound, 409: Conflict}.get(code, Refused)
    return Unavailable(text) if code >= 500 else kind(text)
