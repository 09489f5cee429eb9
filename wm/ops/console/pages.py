"""The console's pages and forms (``/console/…``), server-rendered with Jinja2.

Every page reads through the tenant's :class:`~wm.manager.WorkManager`, the one the JSON
routes call, and every form POSTs an action that mirrors one JSON route (:data:`ACTIONS`):
it needs that route's role, read from the route itself, and is refused with the same 403
before its form is read. The token and its tenant were settled by the gate, as for any
call, and the audit log records the POST.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import RedirectResponse, Response

from wm.errors import InvalidArgument, Unavailable, WorkManagerError
from wm.manager import WorkManager
from wm.ops import gate
from wm.ops.console import session
from wm.views import Role, TokenInfo

logger = logging.getLogger(__name__)

#: Each console action, and the JSON route whose role it needs (method, path).
ACTIONS: dict[str, tuple[str, str]] = {
    "start": ("POST", "/v1/workers/{ref}/start"),
    "stop": ("POST", "/v1/workers/{ref}/stop"),
    "suspend": ("POST", "/v1/workers/{ref}/suspend"),
    "resume": ("POST", "/v1/workers/{ref}/resume"),
    "rollback": ("POST", "/v1/workers/{ref}/rollback"),
    "delete": ("DELETE", "/v1/workers/{ref}"),
    "replay": ("POST", "/v1/deadletters/replay"),
    "purge": ("POST", "/v1/deadletters/purge"),
    "unschedule": ("DELETE", "/v1/schedules/{schedule_id}"),
}
WORKER_ACTIONS = ("start", "stop", "suspend", "resume", "rollback", "delete")
#: What a page says after each action worked (a key in the URL, never text from it).
DONE = {
    "start": "Worker started.",
    "stop": "Worker stopped.",
    "suspend": "Worker suspended.",
    "resume": "Worker resumed.",
    "rollback": "Worker rolled back.",
    "delete": "Worker deleted.",
    "replay": "Dead letter sent back to its worker.",
    "purge": "Dead letter purged.",
    "unschedule": "Schedule removed.",
}
#: Dead letters a worker's page shows, newest first, and read to find them.
RECENT_LETTERS, LETTERS_READ = 20, 1000
STALE_FORM = "this form is not from this session's console (or the session changed): reload"

TEMPLATES = Jinja2Templates(directory=str(resources.files("wm.ops.console") / "templates"))
PAGES = APIRouter(prefix="/console", include_in_schema=False)


def roles_of(routers: Iterable[APIRouter]) -> dict[str, Role]:
    """The role each action needs: its JSON route's (a route gone is an error at start)."""
    needs = {
        (method, route.path): gate.needed_role(route)
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }
    found: dict[str, Role] = {}
    for action, route in ACTIONS.items():
        role = needs.get(route)
        if role is None:
            raise RuntimeError(f"console action {action}: no role on the API route {route}")
        found[action] = role
    return found


# -- what every page has ---------------------------------------------------------------------


def _manager(request: Request) -> WorkManager:
    """The WorkManager of the call's tenant, the JSON routes' own (TenantNotFound if the
    tenant went away)."""
    manager: WorkManager = request.app.state.services.of_tenant(request.state.tenant).manager
    return manager


def _allowed(request: Request) -> dict[str, bool]:
    token: TokenInfo = request.state.token
    roles: Mapping[str, Role] = request.app.state.console_roles
    return {action: token.role.allows(needed) for action, needed in roles.items()}


def base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/") + "/console"


def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    found = session.of_scope(request.scope)
    token: TokenInfo | None = getattr(request.state, "token", None)
    common = {
        "base": base(request),
        "token": token,
        "tenant": getattr(request.state, "tenant", None),
        "csrf": found.form_token() if found is not None and token is not None else "",
        "can": _allowed(request) if token is not None else {},
        "done": DONE.get(request.query_params.get("done", "")),
    }
    response = TEMPLATES.TemplateResponse(request, name, {**common, **context}, status)
    secure_headers(response)
    return response


def secure_headers(response: Response) -> None:
    """Nothing but this server's own files, no framing, nothing cached."""
    response.headers.update(
        {
            "Content-Security-Policy": "default-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'",
            "X-Frame-Options": "DENY",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin",
            "Cache-Control": "no-store",
        }
    )


def failure(request: Request, status: int, detail: str) -> Response:
    request.state.result = detail  # the audit entry's result, as the JSON routes record
    return page(request, "error.html", {"status": status, "detail": detail}, status)


def failed(request: Request, exc: WorkManagerError) -> Response:
    if isinstance(exc, Unavailable):
        logger.error("%s %s: %s", request.method, request.url.path, exc)
        return failure(request, gate.status_of(exc), gate.outage(exc))
    return failure(request, gate.status_of(exc), str(exc))


async def show(
    request: Request, name: str, read: Callable[[WorkManager], dict[str, Any]]
) -> Response:
    """A page of what ``read`` finds in the tenant (an error: its page, with its status)."""
    try:
        context = await run_in_threadpool(lambda: read(_manager(request)))
    except WorkManagerError as exc:
        return failed(request, exc)
    return page(request, name, context)


async def act(
    request: Request,
    action: str,
    call: Callable[[WorkManager, FormData], object],
    then: str,
) -> Response:
    """Run a form's action: the role its JSON route needs first (before the form is read),
    then the session's form token, then ``call``; on success, to ``then``."""
    token: TokenInfo = request.state.token
    needed: Role = request.app.state.console_roles[action]
    if not token.role.allows(needed):
        return failure(
            request,
            403,
            f"token {token.name!r} has role {token.role.value}; this call needs "
            f"{needed.value} or higher",
        )
    form = await request.form()
    found = session.of_scope(request.scope)
    if found is None or not found.proves(form.get("csrf")):
        return failure(request, 403, STALE_FORM)
    try:
        await run_in_threadpool(lambda: call(_manager(request), form))
    except InvalidArgument as exc:
        return failure(request, 422, str(exc))
    except WorkManagerError as exc:
        return failed(request, exc)
    return RedirectResponse(f"{base(request)}{then}?done={action}", 303)


def quoted(text: str) -> str:
    return quote(text, safe="")


# -- workers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRow:
    """A worker as the list shows it (``wm worker show``'s figures)."""

    ref: str
    name: str
    id: str
    topic: str
    status: str
    health: str
    version: int
    queue_depth: int | None
    #: Failed deliveries among those in the health window, in percent (None: none ran).
    error_rate: float | None
    paused: str | None


def worker_rows(manager: WorkManager) -> list[WorkerRow]:
    rows = []
    for info in manager.list_workers():
        details = manager.worker_details(info.id)
        window = details.deliveries_window
        ran = 0 if window is None else window.ok + window.failed
        rate = None if window is None or ran == 0 else 100.0 * window.failed / ran
        rows.append(
            WorkerRow(
                ref=str(info.id),
                name=info.name or "",
                id=str(info.id),
                topic=info.topic,
                status=info.status,
                health=info.health,
                version=info.current_version,
                queue_depth=details.queue_depth,
                error_rate=rate,
                paused=info.paused,
            )
        )
    return rows


@PAGES.get("/")
async def workers(request: Request) -> Response:
    return await show(request, "workers.html", lambda m: {"workers": worker_rows(m)})


def worker_view(manager: WorkManager, ref: str) -> dict[str, Any]:
    details = manager.worker_details(ref)
    wid = str(details.worker.id)
    letters = manager.dead_letters.list(worker_id=wid, limit=LETTERS_READ)
    return {
        "details": details,
        "worker": details.worker,
        "versions": list(reversed(manager.get_worker_history(wid))),
        "transitions": list(reversed(manager.get_worker_transitions(wid))),
        "letters": list(reversed(letters))[:RECENT_LETTERS],
        "schedules": manager.list_schedules(wid),
    }


@PAGES.get("/workers/{ref}")
async def worker(request: Request, ref: str) -> Response:
    return await show(request, "worker.html", lambda m: worker_view(m, ref))


def _worker_call(action: str, ref: str) -> Callable[[WorkManager, FormData], object]:
    calls: dict[str, Callable[[WorkManager, FormData], object]] = {
        "start": lambda m, f: m.start_worker(ref),
        "stop": lambda m, f: m.stop_worker(ref),
        "suspend": lambda m, f: m.suspend_worker(ref),
        "resume": lambda m, f: m.resume_worker(ref),
        "rollback": lambda m, f: m.rollback_worker(ref, _version(f)),
        "delete": lambda m, f: m.delete_worker(ref),
    }
    return calls[action]


def _version(form: FormData) -> int:
    text = str(form.get("version", ""))
    if not text.isdigit() or int(text) < 1:
        raise InvalidArgument(f"version: give an earlier version's number, not {text!r}")
    return int(text)


@PAGES.post("/workers/{ref}/{action}")
async def worker_action(request: Request, ref: str, action: str) -> Response:
    if action not in WORKER_ACTIONS:
        return failure(request, 404, f"no such action: {action!r}")
    then = "/" if action == "delete" else f"/workers/{quoted(ref)}"
    return await act(request, action, _worker_call(action, ref), then)


# -- dead letters and schedules --------------------------------------------------------------


def letters_view(manager: WorkManager, worker_ref: str | None) -> dict[str, Any]:
    wid = None if worker_ref is None else manager.worker_id_of(worker_ref)
    found = manager.dead_letters.list(worker_id=wid, limit=LETTERS_READ)
    names = manager.worker_names(d.worker_id for d in found)
    return {"letters": found, "names": names, "worker_ref": worker_ref}


@PAGES.get("/deadletters")
async def dead_letters(request: Request) -> Response:
    worker_ref = request.query_params.get("worker") or None
    return await show(request, "letters.html", lambda m: letters_view(m, worker_ref))


def letter_view(manager: WorkManager, letter_id: str) -> dict[str, Any]:
    letter = manager.dead_letters.get(letter_id)
    envelope = letter.to_json()["envelope"]
    shown = envelope if isinstance(envelope, str) else json.dumps(envelope, indent=2)
    return {"letter": letter, "envelope": shown}


@PAGES.get("/deadletters/{letter_id}")
async def dead_letter(request: Request, letter_id: str) -> Response:
    return await show(request, "letter.html", lambda m: letter_view(m, letter_id))


def _to_version(form: FormData) -> str:
    chosen = str(form.get("to_version", "current"))
    if chosen not in ("current", "same"):
        raise InvalidArgument(f"to_version: current or same, not {chosen!r}")
    return chosen


@PAGES.post("/deadletters/{letter_id}/replay")
async def replay(request: Request, letter_id: str) -> Response:
    def call(m: WorkManager, f: FormData) -> object:
        return m.dead_letters.replay([letter_id], to_version=_to_version(f))

    return await act(request, "replay", call, f"/deadletters/{quoted(letter_id)}")


@PAGES.post("/deadletters/{letter_id}/purge")
async def purge(request: Request, letter_id: str) -> Response:
    def call(m: WorkManager, f: FormData) -> object:
        return m.dead_letters.purge([letter_id])

    return await act(request, "purge", call, "/deadletters")


def schedules_view(manager: WorkManager) -> dict[str, Any]:
    found = manager.list_schedules()
    names = manager.worker_names(s.worker_id for s in found)
    return {"schedules": found, "names": names}


@PAGES.get("/schedules")
async def schedules(request: Request) -> Response:
    return await show(request, "schedules.html", schedules_view)


@PAGES.post("/schedules/{schedule_id}/remove")
async def unschedule(request: Request, schedule_id: str) -> Response:
    def call(m: WorkManager, f: FormData) -> object:
        m.remove_schedule(schedule_id)
        return None

    return await act(request, "unschedule", call, "/schedules")
