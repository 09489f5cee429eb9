"""The admin HTTP API (``wm api``, the ``[api]`` extra): WorkManager for scripts in any language.

FastAPI on uvicorn: the framework generates the OpenAPI description (``/openapi.json``, docs
at ``/docs``) from the same models that validate requests, so an invalid body is refused with
422 naming the field before any code of ours runs. Every call needs a bearer token
(``wm token create``), checked before the body is read (``wm.ops.gate``); the token's role
decides what it may do (``wm.control.access``), checked before the body is parsed. Every
mutating call is written to the audit log before it runs and completed after it (``wm
audit``); if the log cannot be written, the call is refused with 503 and nothing runs.

Every call works in one tenant: a tenant's token works in its own, and naming another in
``WM-Tenant`` is a 403 that reads the same whether that tenant exists or not; a
deployment-wide admin token works in the tenant ``WM-Tenant`` names (the default one without
it). Another tenant's objects answer exactly as missing ones. Tenants are managed with
``wm tenant``; the API only lists them (``GET /v1/tenants``, admins: a tenant's token sees its
own).

Only ``GET /health/live`` (it says the server is up and nothing else) and the API's own
description (``/openapi.json``, and its pages ``/docs`` and ``/redoc`` with the files they
load, which the API serves itself so they work offline: ``wm.ops.apidocs``) answer without a
token. The worker console (``/console/``, ``wm.ops.console``) makes the same calls for a
browser, its token in a session cookie.
"""

import base64
import binascii
import errno
import ipaddress
import logging
import math
import os
import socket
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from http import HTTPStatus
from importlib import metadata
from typing import Annotated, Any, Literal, get_type_hints

from fastapi import (
    APIRouter,
    Depends,
    FastAPI,
    Header,
    Path,
    Query,
    Request,
    Response,
    Security,
)
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException

from wm import store
from wm.config import Settings
from wm.control import tenants
from wm.engine import engine_class
from wm.errors import (
    CodeSourceError,
    ConfigurationError,
    EngineLoadError,
    EventDecodeError,
    InvalidArgument,
    Unavailable,
    WorkerNotFound,
    WorkManagerError,
)
from wm.events import CloudEvent, decode
from wm.lifecycle import Status
from wm.manager import WorkManager
from wm.names import DEFAULT_TENANT, TENANT_HEADER, TENANT_PATTERN, check_name
from wm.ops import accesslog, apidocs, console, gate, health
from wm.text import storable, storable_data
from wm.views import (
    AuditInfo,
    DeadLetterInfo,
    Overview,
    RecoveryReport,
    Role,
    ScheduleInfo,
    SessionInfo,
    TenantInfo,
    TokenInfo,
    TransitionInfo,
    VersionInfo,
    WorkerInfo,
    field_errors,
)
from wm.workersettings import validate_worker_settings, with_group_mode

logger = logging.getLogger(__name__)
VERSION = metadata.version("workmanager")

#: Connections waiting to be accepted on the API's socket (uvicorn's default).
LISTEN_BACKLOG = 2048
#: The most dead letters one replay call sends, and the fastest rate it may ask for.
MAX_REPLAY = 10_000
MAX_REPLAY_RATE = 1000.0
#: The most messages one look into a subscription shows.
MAX_PEEK = 1000
#: Status code of each group of errors (``wm.errors.GROUPS``), kept by the gate, which the
#: console shares.
ERROR_STATUS = gate.ERROR_STATUS


# -- what goes in and out ------------------------------------------------------------------


class Problem(BaseModel):
    detail: str = Field(description="what went wrong and, where it helps, what to do")
    type: str = Field(description="the WorkManager error class, or the HTTP reason")


def _no_nul(value: Any) -> Any:
    texts = value if isinstance(value, list) else [value]
    if any(isinstance(t, str) and "\x00" in t for t in texts):
        raise ValueError("must not contain NUL (\\x00)")
    if any(isinstance(t, str) and storable(t, None) != t for t in texts):
        raise ValueError("must be Unicode text: a lone surrogate (such as \\udcff) is none")
    return value


class _Strict(BaseModel):
    """Unknown fields are refused, and no text field holds NUL (PostgreSQL's text refuses it;
    worker code with NUL goes as ``code_base64``)."""

    model_config = ConfigDict(extra="forbid")

    _text = field_validator("*")(_no_nul)


class _Code(_Strict):
    code: str | None = Field(None, description="source text (Python, C#)")
    code_base64: str | None = Field(None, description="binary code (a DLL, a zip), base64")
    url: str | None = Field(None, description="fetch the code from here (SSRF-guarded)")
    sha256: str | None = Field(None, description="pin: the code's SHA-256, hex")

    @field_validator("code_base64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"not valid base64 ({exc})") from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "_Code":
        given = [n for n in ("code", "code_base64", "url") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of code, code_base64, url (got {given or 'none'})")
        return self

    def content(self) -> bytes | None:
        if self.code is not None:
            return self.code.encode()
        return base64.b64decode(self.code_base64) if self.code_base64 is not None else None


def _name(kind: str, value: str | None) -> str | None:
    if value is not None:
        try:
            check_name(kind, value)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
    return value


class WorkerCreate(_Code):
    topic: str = Field(description="the topic it consumes")
    mime_type: str = Field(description="its engine: text/x-python, text/x-csharp, …")
    name: str | None = Field(None, description="unique among the tenant's live workers")
    group: str | None = Field(
        None, description="workers of one group take turns (fenced), or share the events"
    )
    group_mode: Literal["exclusive", "shared"] | None = Field(
        None,
        description="exclusive (default): every member runs every event, one at a time; "
        "shared: each event runs on one member (the worker setting group_mode)",
    )
    settings: dict[str, Any] = Field(default_factory=dict, description="per-worker settings")
    start: bool = Field(True, description="start consuming at once")

    _topic = field_validator("topic")(lambda v: _name("topic", v))
    _worker_name = field_validator("name")(lambda v: _name("worker name", v))
    _group = field_validator("group")(lambda v: _name("group", v))

    @field_validator("mime_type")
    @classmethod
    def _engine(cls, value: str) -> str:
        try:
            engine_class(value)
        except EngineLoadError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _settings(self) -> "WorkerCreate":
        try:
            self.settings = with_group_mode(self.settings, self.group_mode)
            validate_worker_settings(self.settings, engine_class(self.mime_type).worker_settings)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        return self


class CodeUpdate(_Code):
    note: str | None = Field(None, description="why, kept with the version")


class Rollback(_Strict):
    version: int = Field(ge=1, le=2**31 - 1, description="an earlier version to make current")


class ScheduleCreate(_Strict):
    worker: str = Field(description="worker id, or a live worker's name")
    event_type: str = Field(description="type of the event each firing sends")
    cron: str | None = Field(None, description="cron expression, e.g. '*/5 * * * *'")
    timezone: str = Field("UTC", description="IANA time zone of the cron expression")
    every_s: float | None = Field(None, description="or: fire every this many seconds")
    data: Any = Field(None, description="the event's data")
    missed: Literal["skip", "catch_up"] = "skip"
    max_catch_up: int = Field(10, ge=1, le=10_000)
    until: AwareDatetime | None = Field(None, description="no firing after this")


class CloudEventIn(BaseModel):
    """A CloudEvent in structured mode; further attributes are extensions."""

    model_config = ConfigDict(extra="allow")
    specversion: Literal["1.0"] = "1.0"
    id: str | None = Field(None, min_length=1, description="default: a fresh UUID")
    source: str = Field(min_length=1)
    type: str = Field(min_length=1)
    subject: str | None = None
    datacontenttype: str | None = None
    data: Any = None


def _one_or_many(value: Any) -> str:
    return "events" if isinstance(value, list) else "event"


#: ``POST /v1/events``'s body: one event, or a list of them; an error's ``loc`` names which
#: (``["body", "event", "type"]``, ``["body", "events", 3, "type"]``).
EventsIn = Annotated[
    Annotated[CloudEventIn, Tag("event")] | Annotated[list[CloudEventIn], Tag("events")],
    Discriminator(_one_or_many),
]


class LetterSelection(_Strict):
    ids: list[str] | None = Field(None, min_length=1, max_length=MAX_REPLAY)
    topic: str | None = None
    worker: str | None = Field(None, description="worker id, or a live worker's name")
    error_type: str | None = None

    @model_validator(mode="after")
    def _ids_or_filters(self) -> "LetterSelection":
        filters = self.topic is not None or self.worker is not None or self.error_type is not None
        if (self.ids is not None) == filters:
            raise ValueError("give ids, or select with topic, worker, error_type; not both")
        return self


class Replay(LetterSelection):
    to_version: Literal["current", "same"] = "current"
    rate_per_s: float = Field(50.0, gt=0, le=MAX_REPLAY_RATE, description="replays per second")
    limit: int = Field(1000, ge=1, le=MAX_REPLAY, description="most letters a filter selects")


#: A dead letter as listed (without its event), and as shown alone (with it, as JSON).
_LETTER = {n: (t, ...) for n, t in get_type_hints(DeadLetterInfo).items() if n != "envelope"}
DeadLetterOut = create_model("DeadLetterOut", **_LETTER)  # type: ignore[call-overload]
DeadLetterDetail = create_model(
    "DeadLetterDetail",
    __base__=DeadLetterOut,
    envelope=(Any, Field(description="the event as it failed: JSON, or the raw text")),
)


class Published(BaseModel):
    reached: int = Field(description="subscriptions the event was routed to")


class PublishedMany(BaseModel):
    reached: list[int] = Field(description="subscriptions each event was routed to, in order")


class Replayed(BaseModel):
    replayed: int
    ids: list[str]


class Purged(BaseModel):
    purged: int


class Health(BaseModel):
    status: Literal["healthy", "unhealthy"]
    reasons: list[str]
    checks: dict[str, dict[str, Any]]
    version: str


class Revisions(BaseModel):
    current: str | None = Field(description="the database's migration, null: never migrated")
    head: str | None = Field(description="the newest migration of the API's own code")
    up_to_date: bool


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": Problem} for code in codes}


_status_of = gate.status_of


# -- who is calling --------------------------------------------------------------------------


class Services:
    """What the routes work with, built once per application, and once per tenant a call
    names (:meth:`of_tenant`: tenants that exist only, so they are few)."""

    def __init__(self, settings: Settings, manager: WorkManager | None = None) -> None:
        self.settings = settings
        self.manager = manager or WorkManager(settings, tenant=DEFAULT_TENANT)
        self._tenants: dict[str, Services] = {DEFAULT_TENANT: self}
        self._lock = threading.Lock()

    def of_tenant(self, tenant: str) -> "Services":
        """The services of ``tenant`` (:class:`TenantNotFound` if it does not exist: asked
        on every call, as a tenant may have been deleted since)."""
        found = self._tenants.get(tenant)
        if tenant != DEFAULT_TENANT:
            tenants.checked(self.settings, tenant)
        if found is None:
            manager = WorkManager(self.settings, bus=self.manager.bus, tenant=tenant)
            with self._lock:
                found = self._tenants.setdefault(tenant, Services(self.settings, manager))
        return found


def _services(
    request: Request,
    _tenant: Annotated[
        str | None,
        Header(
            alias=TENANT_HEADER,
            pattern=TENANT_PATTERN,
            description="the tenant the call works in: a tenant's token may name its own "
            "only (another is a 403, whether it exists or not); a deployment-wide admin "
            "token any (default: the default tenant). Another tenant's workers, "
            "subscriptions, schedules and dead letters are not found, exactly as missing ones",
        ),
    ] = None,
) -> Services:
    """The services of the tenant the call works in, which :class:`wm.ops.gate.Gate`
    settled from the token and the header (the header parameter documents and checks it)."""
    found: Services = request.app.state.services
    return found.of_tenant(request.state.tenant)


Svc = Annotated[Services, Depends(_services)]
BEARER = HTTPBearer(auto_error=False, description="a token from `wm token create`")


def _authenticated(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
) -> TokenInfo:
    """The calling token, which :class:`wm.ops.gate.Gate` found before the call was routed
    (``BEARER`` puts the scheme in the OpenAPI description)."""
    token: TokenInfo = request.state.token
    return token


def _role(needed: Role) -> Any:
    """A route's dependency naming the role it needs; :class:`_Guarded` checks it."""

    def check(token: Annotated[TokenInfo, Depends(_authenticated)]) -> TokenInfo:
        return token

    check.needed = needed  # type: ignore[attr-defined]
    return Depends(check)


class _Guarded(APIRoute):
    """A route that checks the caller's role and the query before FastAPI reads the body:
    a viewer's malformed body on an operator's route is a 403, not a 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        needed = gate.needed_role(self)
        if needed is None:
            return handler

        async def guarded(request: Request) -> Response:
            token: TokenInfo = request.state.token
            if not token.role.allows(needed):
                raise HTTPException(
                    403,
                    f"token {token.name!r} has role {token.role.value}; this call needs "
                    f"{needed.value} or higher",
                )
            _check_parameters(request)
            return await handler(request)

        return guarded


def _check_parameters(request: Request) -> None:
    """A query parameter the call does not take is refused, not ignored (``?staus=failed``
    listing every worker would be worse than an error), and no parameter may hold NUL, which
    no name, id or filter contains and PostgreSQL's text refuses."""
    route = request.scope.get("route")
    known = _query_names(route.dependant) if isinstance(route, APIRoute) else set()
    takes = ", ".join(sorted(known)) or "none"
    errors = [
        {"loc": ("query", name), "msg": f"unknown parameter (this call takes: {takes})"}
        for name in sorted(set(request.query_params) - known)
    ]
    for where, values in (("path", request.path_params), ("query", request.query_params)):
        errors += [
            {"loc": (where, name), "msg": "must not contain NUL (\\x00)"}
            for name, value in values.items()
            if "\x00" in str(value)
        ]
    if errors:
        raise RequestValidationError([{**e, "type": "value_error"} for e in errors])


def _query_names(dependant: Dependant) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


VIEWER, OPERATOR, ADMIN = _role(Role.VIEWER), _role(Role.OPERATOR), _role(Role.ADMIN)
Ref = Annotated[str, Path(description="worker id, or a live worker's name", min_length=1)]


# -- the application -----------------------------------------------------------------------


def create_app(settings: Settings) -> FastAPI:
    """The admin API on ``settings``' database, broker and Redis."""
    app = FastAPI(
        title="WorkManager admin API",
        version=VERSION,
        description=__doc__,
        responses=_errors(400, 401, 403, 404, 413, 503),
        docs_url=None,
        redoc_url=None,
    )
    docs = apidocs.add_docs(app)
    services = app.state.services = Services(settings)
    app.add_exception_handler(WorkManagerError, _failed)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _refused)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _crashed)
    routers = (WORKERS, EVENTS, LETTERS, SCHEDULES, SUBSCRIPTIONS, TOKENS, OPERATIONS)
    for router in routers:
        app.include_router(router)
    pages = console.add_console(app, routers)  # each action needs its JSON route's role
    # Added last, run first: the token, then the audit entry, then the tenant named, then
    # the body's size.
    app.add_middleware(gate.BodyLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(gate.TenantGuard)
    app.add_middleware(gate.Audited, audit=services.manager.audit)
    public_paths = frozenset({str(app.openapi_url), "/health/live", *docs, *pages})
    app.add_middleware(
        gate.Gate,
        tokens=services.manager.tokens,
        public=public_paths,
        browser=console.browser(),
    )
    app.add_middleware(accesslog.AccessLog)
    return app


async def _failed(request: Request, exc: WorkManagerError) -> JSONResponse:
    request.state.result = f"{type(exc).__name__}: {exc}"
    code = _status_of(exc)
    if isinstance(exc, Unavailable):
        logger.error("%s %s: %s", request.method, request.url.path, exc)
        return gate.problem(code, gate.outage(exc), type(exc).__name__)
    if code != 422:
        return gate.problem(code, str(exc), type(exc).__name__)
    loc = ["body", "code"] if isinstance(exc, CodeSourceError | EngineLoadError) else ["body"]
    body = {"detail": [{"loc": loc, "msg": storable(str(exc)), "type": type(exc).__name__}]}
    return JSONResponse(body, status_code=422)


async def _refused(request: Request, exc: HTTPException) -> JSONResponse:
    request.state.result = str(exc.detail)
    phrase = HTTPStatus(exc.status_code).phrase
    return gate.problem(exc.status_code, str(exc.detail), phrase, **(exc.headers or {}))


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    request.state.result = field_errors(exc.errors())
    # what it echoes may be text no encoder takes (a lone surrogate): made storable
    return JSONResponse({"detail": storable_data(jsonable_encoder(exc.errors()))}, 422)


async def _crashed(request: Request, exc: Exception) -> JSONResponse:
    """A bug: 500 saying only that (the traceback goes to the log, the audit entry records
    the 500)."""
    detail = "the API failed on this call; its log has the detail"
    return gate.problem(500, detail, HTTPStatus(500).phrase)


@contextmanager
def _field(*loc: str) -> Iterator[None]:
    """An :class:`InvalidArgument` inside is a 422 naming ``loc``, as FastAPI's own are."""
    try:
        yield
    except InvalidArgument as exc:
        raise RequestValidationError(
            [{"loc": loc, "msg": str(exc), "type": "value_error"}]
        ) from exc


# -- workers -------------------------------------------------------------------------------

WORKERS = APIRouter(prefix="/v1/workers", tags=["workers"], route_class=_Guarded)


@WORKERS.get("", dependencies=[VIEWER])
def list_workers(
    svc: Svc,
    topic: str | None = None,
    group: str | None = None,
    status: Annotated[Status | None, Query(description="default: every live worker")] = None,
) -> list[WorkerInfo]:
    found = svc.manager.list_workers(topic=topic, group=group, status=status)
    return found


@WORKERS.post("", status_code=201, dependencies=[OPERATOR], responses=_errors(409))
def create_worker(svc: Svc, body: WorkerCreate) -> WorkerInfo:
    """Create a worker from inline code or a URL; started unless ``start`` is false."""
    return svc.manager.create_worker(
        code=body.content(),
        url=body.url,
        mime_type=body.mime_type,
        topic=body.topic,
        group=body.group,
        name=body.name,
        start=body.start,
        sha256=body.sha256,
        settings=body.settings,
    )


@WORKERS.get("/{ref}", dependencies=[VIEWER], responses=_errors(404))
def get_worker(svc: Svc, ref: Ref) -> WorkerInfo:
    return svc.manager.get_worker(ref)


@WORKERS.post("/{ref}/start", dependencies=[OPERATOR], responses=_errors(404, 409))
def start_worker(
    svc: Svc,
    ref: Ref,
    delay_s: Annotated[
        float | None,
        Query(gt=0, description="start this much later: the worker is pending until then"),
    ] = None,
) -> WorkerInfo:
    """Start consuming the worker's topic (idempotent); with ``delay_s``, later."""
    return svc.manager.start_worker(ref, delay_s=delay_s)


@WORKERS.post("/{ref}/stop", dependencies=[OPERATOR], responses=_errors(404, 409))
def stop_worker(
    svc: Svc,
    ref: Ref,
    grace_s: Annotated[
        float | None,
        Query(ge=0, description="wait this long for deliveries in flight, then kill the engine"),
    ] = None,
) -> WorkerInfo:
    """Stop consuming, wait for deliveries in flight (then kill the engine: ``killed``),
    unload the engine; the queue keeps what arrives."""
    return svc.manager.stop_worker(ref, grace_s=grace_s)


@WORKERS.post("/{ref}/suspend", dependencies=[OPERATOR], responses=_errors(404, 409))
def suspend_worker(svc: Svc, ref: Ref) -> WorkerInfo:
    """Pause consuming on every node; the queue keeps what arrives, engines stay loaded."""
    return svc.manager.suspend_worker(ref)


@WORKERS.post("/{ref}/resume", dependencies=[OPERATOR], responses=_errors(404, 409))
def resume_worker(svc: Svc, ref: Ref) -> WorkerInfo:
    """Consume again what accumulated while suspended."""
    return svc.manager.resume_worker(ref)


@WORKERS.delete("/{ref}", dependencies=[ADMIN], responses=_errors(404, 409))
def delete_worker(svc: Svc, ref: Ref) -> WorkerInfo:
    """Delete the worker and its queue; versions and transitions stay for audit."""
    return svc.manager.delete_worker(ref)


@WORKERS.put("/{ref}/code", dependencies=[OPERATOR], responses=_errors(404, 409))
def update_code(svc: Svc, ref: Ref, body: CodeUpdate) -> WorkerInfo:
    """Add a code version and make it current (hot reload on every node)."""
    content = body.content()
    if content is None:
        assert body.url is not None
        info = svc.manager.load_code_from_url(ref, body.url, sha256=body.sha256, note=body.note)
    else:
        info = svc.manager.load_code_from_content(ref, content, sha256=body.sha256, note=body.note)
    return info


@WORKERS.post("/{ref}/rollback", dependencies=[OPERATOR], responses=_errors(404, 409))
def rollback(svc: Svc, ref: Ref, body: Rollback) -> WorkerInfo:
    return svc.manager.rollback_worker(ref, body.version)


@WORKERS.get("/{ref}/versions", dependencies=[VIEWER], responses=_errors(404))
def versions(svc: Svc, ref: Ref) -> list[VersionInfo]:
    """Every code version, oldest first."""
    return svc.manager.get_worker_history(ref)


@WORKERS.get("/{ref}/transitions", dependencies=[VIEWER], responses=_errors(404))
def transitions(svc: Svc, ref: Ref) -> list[TransitionInfo]:
    """Every state and code change, oldest first."""
    return svc.manager.get_worker_transitions(ref)


@WORKERS.get("/{ref}/details", dependencies=[VIEWER], responses=_errors(404))
def details(svc: Svc, ref: Ref) -> dict[str, Any]:
    """The worker (its fields as ``GET /v1/workers/{ref}`` has them) with what ``wm worker
    show`` adds: ``queue``, ``queue_depth``, ``dead_letters``, ``last_error``,
    ``deliveries_last_minute``, ``deliveries_window``, ``breaker``; a part whose service does
    not answer is null and named in ``unavailable``."""
    return svc.manager.worker_details(ref).to_json()


@WORKERS.get(
    "/{ref}/code",
    dependencies=[OPERATOR],
    responses={**_errors(404), 200: {"content": {"application/octet-stream": {}}}},
    response_class=Response,
)
def code(
    svc: Svc,
    ref: Ref,
    version: Annotated[int | None, Query(ge=1, description="default: the current one")] = None,
) -> Response:
    """A version's code as it was deployed (operators: code may hold what viewers should not
    read)."""
    info = svc.manager.get_worker(ref, health=False)
    found = svc.manager.get_code(info.id, version or info.current_version)
    return Response(found, media_type="application/octet-stream")


@WORKERS.get("/{ref}/sessions/{session}", dependencies=[VIEWER], responses=_errors(404))
def session(svc: Svc, ref: Ref, session: Annotated[str, Path(min_length=1)]) -> SessionInfo:
    """The engine instance (``host:pid``) a session of the worker is bound to, and the seconds
    its binding has left; both null when it is unbound."""
    return svc.manager.session(ref, session)


# -- events --------------------------------------------------------------------------------

EVENTS = APIRouter(prefix="/v1/events", tags=["events"], route_class=_Guarded)


@EVENTS.post("", status_code=202, dependencies=[OPERATOR])
def publish(
    svc: Svc,
    event: EventsIn,
    topic: Annotated[str | None, Query(description="default: each event's type")] = None,
) -> Published | PublishedMany:
    """Publish one CloudEvent, or a JSON list of them (in order, in batches), to a topic.

    A list is checked whole first: a bad event is a 422 naming its index, and none is sent.
    A 503 for a list says how many of its events (the first ones) were published."""
    if topic is not None:
        with _field("query", "topic"):
            check_name("topic", topic)
    if isinstance(event, list):
        events = [_decoded(item, "body", "events", index) for index, item in enumerate(event)]
        return PublishedMany(reached=svc.manager.publish_many(events, topic))
    return Published(reached=svc.manager.publish(_decoded(event, "body"), topic))


def _decoded(event: CloudEventIn, *loc: str | int) -> CloudEvent:
    fields = event.model_dump(exclude_none=True)
    fields.setdefault("id", str(uuid.uuid4()))
    try:
        return decode(fields)
    except EventDecodeError as exc:
        if len(loc) == 1:  # one event: the error as it always was
            raise
        raise RequestValidationError(
            [{"loc": loc, "msg": str(exc), "type": "value_error"}]
        ) from exc


# -- dead letters --------------------------------------------------------------------------

LETTERS = APIRouter(prefix="/v1/deadletters", tags=["dead letters"], route_class=_Guarded)


@LETTERS.get("", dependencies=[VIEWER], response_model=list[DeadLetterOut])  # type: ignore[valid-type]
def list_letters(
    svc: Svc,
    topic: str | None = None,
    worker: Annotated[str | None, Query(description="worker id or live name")] = None,
    error_type: str | None = None,
    include_replayed: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_REPLAY)] = 100,
) -> list[dict[str, Any]]:
    """Dead letters, oldest failure first."""
    found = svc.manager.dead_letters.list(
        topic=topic,
        worker_id=_worker_id(svc, worker, "query"),
        error_type=error_type,
        include_replayed=include_replayed,
        limit=limit,
    )
    return [d.to_json(envelope=False) for d in found]


@LETTERS.get(
    "/{letter_id}", dependencies=[VIEWER], responses=_errors(404), response_model=DeadLetterDetail
)
def get_letter(svc: Svc, letter_id: str) -> dict[str, Any]:
    """One dead letter with the event as it failed."""
    return svc.manager.dead_letters.get(letter_id).to_json()  # the envelope as JSON, or its text


@LETTERS.post("/replay", dependencies=[OPERATOR], responses=_errors(404))
def replay(svc: Svc, body: Replay) -> Replayed:
    """Send dead letters back to their worker (by id, or every one a filter selects)."""
    ids = body.ids or [
        d.id
        for d in svc.manager.dead_letters.list(
            topic=body.topic,
            worker_id=_worker_id(svc, body.worker, "body"),
            error_type=body.error_type,
            limit=body.limit,
        )
    ]
    sent = svc.manager.dead_letters.replay(
        ids, to_version=body.to_version, rate_per_s=body.rate_per_s
    )
    return Replayed(replayed=sent, ids=ids)


@LETTERS.post("/purge", dependencies=[ADMIN], responses=_errors(404))
def purge(svc: Svc, body: LetterSelection) -> Purged:
    """Delete dead letters (by id or short id, each of which must exist; or every one a
    filter selects)."""
    count = svc.manager.dead_letters.purge(
        body.ids,
        topic=body.topic,
        worker_id=_worker_id(svc, body.worker, "body"),
        error_type=body.error_type,
    )
    return Purged(purged=count)


def _worker_id(svc: Services, reference: str | None, where: str) -> str | None:
    """A dead letter's worker filter: a worker's id (a deleted one's too, its letters stay
    reachable) or a live worker's name."""
    if reference is None:
        return None
    with _field(where, "worker"):
        try:
            return svc.manager.worker_id_of(reference)
        except WorkerNotFound as exc:
            raise InvalidArgument(str(exc)) from None


# -- schedules -----------------------------------------------------------------------------

SCHEDULES = APIRouter(prefix="/v1/schedules", tags=["schedules"], route_class=_Guarded)


@SCHEDULES.get("", dependencies=[VIEWER], responses=_errors(404))
def list_schedules(
    svc: Svc,
    worker: Annotated[str | None, Query(description="worker id or live name")] = None,
) -> list[ScheduleInfo]:
    """Schedules, oldest first, each with its next firing."""
    return svc.manager.list_schedules(worker)


@SCHEDULES.post("", status_code=201, dependencies=[OPERATOR], responses=_errors(404, 409))
def add_schedule(svc: Svc, body: ScheduleCreate) -> ScheduleInfo:
    """Send an event to a worker on a cron expression or an interval (``celery beat``)."""
    fields = body.model_dump()
    return svc.manager.add_schedule(fields.pop("worker"), **fields)


@SCHEDULES.delete("/{schedule_id}", dependencies=[OPERATOR], responses=_errors(404))
def remove_schedule(svc: Svc, schedule_id: str) -> Purged:
    """Remove a schedule; firings already sent stay queued."""
    svc.manager.remove_schedule(schedule_id)
    return Purged(purged=1)


# -- subscriptions -------------------------------------------------------------------------

SUBSCRIPTIONS = APIRouter(prefix="/v1/subscriptions", tags=["subscriptions"], route_class=_Guarded)
Topic = Annotated[str, Path(description="the topic (in the call's tenant)", min_length=1)]
SubscriptionName = Annotated[str, Path(description="the subscription's name", min_length=1)]


class SubscriptionOut(BaseModel):
    topic: str
    queue: str = Field(description="the queue a kombu client reads")
    worker_id: str | None = Field(description="the worker fed, null for a plain subscription")
    depth: int = Field(description="messages waiting in the queue")


class Subscribed(BaseModel):
    topic: str
    name: str
    queue: str = Field(description="the queue a kombu client reads (`wm consume` too)")


@SUBSCRIPTIONS.get("", dependencies=[VIEWER])
def list_subscriptions(svc: Svc, topic: str | None = None) -> list[SubscriptionOut]:
    """Every subscription of the tenant (workers' and plain ones), with its queue depth."""
    return [SubscriptionOut(**found) for found in svc.manager.list_subscriptions(topic)]


@SUBSCRIPTIONS.get("/{topic}/{name}/messages", dependencies=[VIEWER], responses=_errors(404))
def peek(
    svc: Svc,
    topic: Topic,
    name: SubscriptionName,
    count: Annotated[int, Query(ge=1, le=MAX_PEEK)] = MAX_PEEK,
) -> list[str]:
    """The messages waiting in a plain subscription, oldest first, each as the text it
    holds (a CloudEvent in JSON), none taken: they stay queued in their order (``wm consume
    --peek``). Reading them off the queue is a client's own (``wm consume``, kombu)."""
    bodies = svc.manager.consume(topic, name, count=count, peek=True)
    return [b if isinstance(b, str) else b.decode("utf-8", "replace") for b in bodies]


@SUBSCRIPTIONS.put("/{topic}/{name}", dependencies=[OPERATOR])
def subscribe(svc: Svc, topic: Topic, name: SubscriptionName) -> Subscribed:
    """Feed the topic into a named durable queue any kombu client can read (``wm
    subscribe``); subscribing again changes nothing."""
    with _field("path"):
        queue = svc.manager.subscribe(topic, name)
    return Subscribed(topic=topic, name=name, queue=queue)


@SUBSCRIPTIONS.delete("/{topic}/{name}", dependencies=[OPERATOR], responses=_errors(404))
def unsubscribe(svc: Svc, topic: Topic, name: SubscriptionName) -> Purged:
    """Remove a plain subscription and its queue, with what the queue holds."""
    svc.manager.unsubscribe(topic, name)
    return Purged(purged=1)


# -- tokens --------------------------------------------------------------------------------

TOKENS = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=_Guarded)
#: The longest lifetime a token made over HTTP may be given (ten years): beyond it, ask for
#: one that never expires.
MAX_TOKEN_LIFETIME_S = 10 * 365 * 86400


class TokenCreate(_Strict):
    name: str = Field(description="unique among the tokens in force")
    role: Role = Field(description="viewer < operator < admin, within the call's tenant")
    expires_in_s: float | None = Field(
        None, gt=0, le=MAX_TOKEN_LIFETIME_S, description="default: never expires"
    )

    _token_name = field_validator("name")(lambda v: _name("token name", v))


class TokenCreated(BaseModel):
    token: TokenInfo
    secret: str = Field(description="the bearer token's text: shown this once, never again")


@TOKENS.get("", dependencies=[ADMIN])
def list_tokens(svc: Svc, include_revoked: bool = False) -> list[TokenInfo]:
    """The tenant's tokens in force, and with ``include_revoked`` the revoked and expired
    ones too (admins only; deployment-wide tokens are managed with ``wm token``, on the
    deployment's own machine)."""
    return svc.manager.tokens.list(include_revoked=include_revoked, own_tenant=True)


@TOKENS.post("", status_code=201, dependencies=[ADMIN], responses=_errors(409))
def create_token(svc: Svc, body: TokenCreate) -> TokenCreated:
    """A new token of the call's tenant; its secret is in this answer only."""
    expires = None if body.expires_in_s is None else timedelta(seconds=body.expires_in_s)
    with _field("body", "name"):
        info, secret = svc.manager.tokens.create(body.name, body.role, expires_in=expires)
    return TokenCreated(token=info, secret=secret)


@TOKENS.delete("/{token}", dependencies=[ADMIN], responses=_errors(404))
def revoke_token(
    svc: Svc, token: Annotated[str, Path(description="token id, short id or name")]
) -> TokenInfo:
    """Revoke one of the tenant's tokens; it stops working at once."""
    return svc.manager.tokens.revoke(token, own_tenant=True)


# -- health, identity, audit ---------------------------------------------------------------

OPERATIONS = APIRouter(route_class=_Guarded)


@OPERATIONS.get("/health/live", tags=["health"])
def live() -> dict[str, str]:
    """200 while the server answers (a liveness probe); needs no token."""
    return {"status": "alive"}


@OPERATIONS.get("/v1/health", tags=["health"], dependencies=[VIEWER])
def api_health(svc: Svc, response: Response) -> Health:
    """Whether this server reaches the broker, Redis and the database (503 if not). The
    answer names no URL or host (the server's log has each failure in full)."""
    checks, reasons = health.dependency_checks(svc.settings)
    for reason in reasons:
        logger.error("health check: %s", reason)
    shown = {name: {"ok": check["ok"]} for name, check in checks.items()}
    failed = [name for name, check in checks.items() if not check["ok"]]
    if failed:
        response.status_code = 503
    status: Literal["healthy", "unhealthy"] = "unhealthy" if failed else "healthy"
    reasons = [f"{name} unreachable from the API server" for name in failed]
    return Health(status=status, reasons=reasons, checks=shown, version=VERSION)


@OPERATIONS.get("/v1/status", tags=["health"], dependencies=[VIEWER], responses=_errors(503))
def cluster_status(svc: Svc) -> Overview:
    """The tenant's part of the cluster at a glance (``wm status``): nodes that answer a
    ping (shared by every tenant), its workers by status and health, its deepest queues,
    its dead letters per topic, its breakers, and recovery. A part whose service (broker,
    Redis) does not answer is null and named in ``unavailable``."""
    return svc.manager.status(own_tenant=True)


@OPERATIONS.post(
    "/v1/recover", tags=["health"], dependencies=[OPERATOR], responses=_errors(409, 503)
)
def recover(svc: Svc) -> RecoveryReport:
    """Run recovery now (``wm recover``), as a starting node does: repair the routing table,
    declare every subscription's queue, check each running worker's code, publish the
    outbox. The whole deployment is recovered, but the report counts and names the tenant's
    routes, queues, workers and events only. ``failures`` names each worker it could not
    bring back, and why; 409 while a recovery runs elsewhere."""
    return svc.manager.recover(own_tenant=True)


@OPERATIONS.get("/v1/tenants", tags=["tenants"], dependencies=[ADMIN])
def list_tenants(
    svc: Svc, token: Annotated[TokenInfo, Depends(_authenticated)]
) -> list[TenantInfo]:
    """Tenants by name, with their live workers and limits (``wm tenant list``): every one
    for a deployment-wide admin token, its own for a tenant's. Tenants are made, changed and
    deleted with ``wm tenant``, on the deployment's own machine."""
    return [t for t in svc.manager.list_tenants() if token.tenant in (None, t.name)]


@OPERATIONS.get("/v1/database", tags=["health"], dependencies=[VIEWER], responses=_errors(503))
def database(svc: Svc) -> Revisions:
    """The database's migration revision and the newest one the API's code has
    (``wm db current``); migrating is ``wm db upgrade``'s, on the deployment's own machine."""
    current = store.current_revision(svc.settings)
    head = store.head_revision(svc.settings)
    return Revisions(current=current, head=head, up_to_date=current == head)


@OPERATIONS.get("/v1/whoami", tags=["tokens"])
def whoami(token: Annotated[TokenInfo, Depends(_authenticated)]) -> TokenInfo:
    """The calling token: id, name, role, times, and its tenant (null: deployment-wide)."""
    return token


@OPERATIONS.get("/v1/audit", tags=["audit"], dependencies=[ADMIN])
def audit_log(
    svc: Svc,
    token: Annotated[str | None, Query(description="token id or name")] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_REPLAY)] = 100,
) -> list[AuditInfo]:
    """The newest audit entries of calls that worked in the tenant, oldest first (admins
    only)."""
    return svc.manager.audit.list(token=token, since=since, limit=limit, tenant=svc.manager.tenant)


# -- serving -------------------------------------------------------------------------------


def check_exposure(bind: str, *, tls: bool, insecure: bool) -> None:
    """Refuse to serve tokens in clear text beyond this machine unless told ``--insecure``."""
    if tls or insecure or _loopback(bind):
        return
    raise ConfigurationError(
        f"refusing to serve the admin API on {bind} without TLS: bearer tokens would cross "
        "the network in clear text. Set WM_API_TLS_CERT and WM_API_TLS_KEY (or --tls-cert, "
        "--tls-key), bind to 127.0.0.1, or pass --insecure when a TLS proxy is in front"
    )


def _loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def serve(settings: Settings, *, insecure: bool = False) -> None:
    """Run the API with uvicorn until SIGINT or SIGTERM (``wm api``); the requests in flight
    then have WM_SHUTDOWN_GRACE_S to finish."""
    import uvicorn

    cert, key = settings.api_tls_cert, settings.api_tls_key
    if bool(cert) != bool(key):
        raise ConfigurationError("TLS needs both WM_API_TLS_CERT and WM_API_TLS_KEY")
    for variable, path in (("WM_API_TLS_CERT", cert), ("WM_API_TLS_KEY", key)):
        if path and not os.path.isfile(path):
            raise ConfigurationError(f"{variable}={path!r}: no such file")
    check_exposure(settings.api_bind, tls=bool(cert), insecure=insecure)
    store_revision = store.current_revision(settings)
    if store_revision != store.head_revision(settings):
        raise ConfigurationError(
            f"the database is at revision {store_revision}, not the head: run wm db upgrade"
        )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        ssl_certfile=cert or None,
        ssl_keyfile=key or None,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn's lines through WorkManager's handler (WM_LOG_FORMAT)
        access_log=False,  # wm.ops.accesslog's instead
        server_header=False,
        # a stop waits for the requests in flight that long at most (one whose client
        # stalls mid-body would hold it for ever)
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) or None,
    )
    sock = _listen(settings.api_bind, settings.api_port)
    accesslog.enable(settings)
    accesslog.announce(settings, _url(settings.api_bind, sock.getsockname()[1], tls=bool(cert)))
    uvicorn.Server(config).run(sockets=[sock])


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``, bound here rather than by uvicorn so that a
    taken port is one clear error, not uvicorn's log text and exit code."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise ConfigurationError(
                f"port {port} on {host} is taken ({reason}); pass --port or set WM_API_PORT"
            ) from exc
        raise ConfigurationError(
            f"cannot listen on {host} port {port} ({reason}); pass --bind and --port or set "
            "WM_API_BIND and WM_API_PORT"
        ) from exc
    return sock


def _url(host: str, port: int, *, tls: bool) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"
