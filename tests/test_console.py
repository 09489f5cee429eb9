"""The worker console (``/console/``) in a real browser: Debian's headless chromium driven
by Selenium through Debian's chromedriver (never one selenium-manager would download), on a
real ``wm api`` process and a real node, for each role and for a tenant's token.

Each test logs in as a user would, reads the pages, presses the buttons its role has, checks
the effect through the Python API, and sends a POST its role may not (a 403, as from the JSON
API). Screenshots are kept in ``$TEST_ARTEFACTS_DIR/console`` (default
``tests/artefacts/console``, git-ignored); the path is printed. Chromium or chromedriver
missing is a skip locally and a failure in CI."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import need
from tests.helpers import STUB, artefacts, eventually, free_port, stub
from tests.test_api import start_api, stop
from wm import Settings, WorkManager, make_event
from wm.control.access import Tokens
from wm.views import Role

#: Parked at the first failure; neither the breaker nor health pauses the worker.
FAST = {"max_retries": 0, "timeout_s": 10, "failure_threshold": 0, "pause_when_unhealthy": False}
#: The buttons each role finds on a worker's page and on a dead letter's.
WORKER_BUTTONS = {
    Role.VIEWER: set(),
    Role.OPERATOR: {"start", "stop", "suspend", "resume", "rollback"},
    Role.ADMIN: {"start", "stop", "suspend", "resume", "rollback", "delete"},
}
LETTER_BUTTONS = {
    Role.VIEWER: set(),
    Role.OPERATOR: {"replay"},
    Role.ADMIN: {"replay", "purge"},
}


@dataclass
class World:
    url: str
    settings: Settings
    secrets: dict[str, str]
    #: Worker ids by name: echo (running), idle (stopped, 2 events waiting), fails (its two
    #: events dead-lettered), and acme's own worker in tenant acme.
    workers: dict[str, str]
    letters: list[str]
    node: Any


@pytest.fixture
def world(pg_settings: Settings, start_node: Any) -> Iterator[World]:
    manager = WorkManager(pg_settings)
    manager.create_tenant("acme")
    acme = WorkManager(pg_settings, tenant="acme")
    tokens = Tokens(pg_settings)
    secrets = {r.value: tokens.create(f"console-{r.value}", r)[1] for r in Role}
    secrets["acme"] = tokens.create("acme-operator", Role.OPERATOR, tenant="acme")[1]
    workers = _workers(manager, acme)
    node = start_node(pg_settings)
    node.consuming(f"console.fail::{workers['fails']}")
    for n in range(2):
        manager.publish(make_event("console.fail", "/t", {"n": n}, id=f"fail-{n}"))
        manager.publish(make_event("console.idle", "/t", {"n": n}, id=f"idle-{n}"))
    found = eventually(lambda: len(x := manager.dead_letters.list()) == 2 and x)
    url, process = start_api(pg_settings)
    yield World(url, pg_settings, secrets, workers, [d.id for d in found], node)
    out = stop(process)
    assert "Traceback" not in out, out


def _workers(manager: WorkManager, acme: WorkManager) -> dict[str, str]:
    def made(owner: WorkManager, name: str, topic: str, **kwargs: Any) -> str:
        code = kwargs.pop("code", stub())
        info = owner.create_worker(code=code, mime_type=STUB, topic=topic, name=name, **kwargs)
        return str(info.id)

    workers = {
        "echo": made(manager, "echo", "console.in"),
        "idle": made(manager, "idle", "console.idle"),
        "fails": made(manager, "fails", "console.fail", code=stub(fail="boom"), settings=FAST),
        "acme-echo": made(acme, "acme-echo", "acme.in"),
    }
    manager.stop_worker("idle")  # its queue keeps what arrives
    manager.add_schedule("echo", event_type="console.tick", every_s=3600)
    manager.load_code_from_content(
        "echo", stub(output_type="console.out"), note="second"
    )  # a rollback target
    return workers


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Headless chromium under Selenium; every request off this machine goes to a proxy
    that is not there, so a page that loaded anything from the internet would show it."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        need("chromium and chromedriver", FileNotFoundError("apt-get install -y chromium-driver"))
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1360,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--proxy-server=http://127.0.0.1:{free_port()}",
        "--proxy-bypass-list=127.0.0.1",
    ):
        options.add_argument(flag)
    driver_ = webdriver.Chrome(options=options, service=Service(executable_path=str(driver)))
    driver_.set_page_load_timeout(60)
    yield driver_
    driver_.quit()


def _shot(browser: Any, name: str) -> Path:
    path = artefacts("console") / f"{name}.png"
    assert browser.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    return path


def _login(browser: Any, world: World, secret: str, tenant: str = "") -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{world.url}/console/")
    assert browser.current_url == f"{world.url}/console/login", browser.current_url
    browser.find_element(By.ID, "token").send_keys(secret)
    if tenant:
        browser.find_element(By.ID, "tenant-name").send_keys(tenant)
    _press(browser, "login")


def _press(browser: Any, element_id: str) -> None:
    """Press a button or link and wait for the page it leads to.

    The old page is marked in its window object, which a navigation replaces. Asking
    whether an old element went stale instead is racy: while the page is swapped,
    chromedriver may answer "Node with given id does not belong to the document", an
    unknown error rather than a stale element, so every WebDriver error is retried here.
    """
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    browser.execute_script("window.wmOldPage = true")
    browser.find_element(By.ID, element_id).click()
    WebDriverWait(browser, 30, ignored_exceptions=(WebDriverException,)).until(
        lambda b: b.execute_script(
            "return window.wmOldPage === undefined && document.readyState === 'complete'"
        )
    )


def _ids(browser: Any, css: str) -> set[str]:
    from selenium.webdriver.common.by import By

    return {e.get_attribute("id") for e in browser.find_elements(By.CSS_SELECTOR, css)}


def _buttons(browser: Any) -> set[str]:
    """The actions a page offers (buttons ``action-NAME``)."""
    return {i.removeprefix("action-") for i in _ids(browser, "button[id^='action-']")}


def _text(browser: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.ID, element_id).text)


def _rows(browser: Any, table: str) -> list[list[str]]:
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
    return [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]


def _session(browser: Any, world: World) -> httpx.Client:
    """An HTTP client with the browser's session cookie (to send what no button sends)."""
    cookie = browser.get_cookie("wm_console")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie
    return httpx.Client(base_url=world.url, cookies={"wm_console": cookie["value"]}, timeout=30)


def _form_token(browser: Any) -> str:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.CSS_SELECTOR, "input[name='csrf']")
    return str(field.get_attribute("value"))


@pytest.mark.parametrize("role", list(Role), ids=[r.value for r in Role])
def test_each_role_sees_the_workers_and_only_its_own_actions(
    world: World, browser: Any, role: Role
) -> None:
    from selenium.webdriver.common.by import By

    _login(browser, world, world.secrets[role.value])
    assert browser.current_url == f"{world.url}/console/", browser.page_source[-1500:]
    assert _text(browser, "role") == role.value and _text(browser, "tenant") == "default"
    listed = {row[0]: row for row in _rows(browser, "workers")}
    assert set(listed) == {"echo", "idle", "fails"}, listed  # not acme's
    # name, id, topic, status, health, version, queue depth, error rate
    assert listed["echo"][3:6] == ["running", listed["echo"][4], "2"], listed["echo"]
    assert listed["idle"][3] == "stopped" and listed["idle"][6] == "2", listed["idle"]
    _shot(browser, f"{role.value}-workers")

    browser.get(f"{world.url}/console/workers/{world.workers['echo']}")
    assert _text(browser, "status") == "running"
    assert [r[0] for r in _rows(browser, "versions")] == ["2 ✓", "1"]
    assert any("created" in " ".join(r) for r in _rows(browser, "transitions"))
    assert _buttons(browser) == WORKER_BUTTONS[role]
    _shot(browser, f"{role.value}-worker")

    browser.get(f"{world.url}/console/workers/{world.workers['fails']}")
    assert "boom" in _text(browser, "errors")  # its recent errors
    browser.get(f"{world.url}/console/deadletters/{world.letters[0]}")
    assert "boom" in _text(browser, "message") and '"console.fail"' in _text(browser, "envelope")
    assert _buttons(browser) == LETTER_BUTTONS[role]
    _shot(browser, f"{role.value}-deadletter")
    browser.get(f"{world.url}/console/schedules")
    [schedule] = _rows(browser, "schedules")
    assert schedule[1:4] == ["echo", "console.tick", "every 3600 s"], schedule
    removable = {"Remove"} if role.allows(Role.OPERATOR) else set()
    assert {b.text for b in browser.find_elements(By.TAG_NAME, "button")} - {"Log out"} == removable
    _act_as(role, world, browser)


def _act_as(role: Role, world: World, browser: Any) -> None:
    """One action the role may take, seen through the Python API; one it may not, a 403."""
    acts = {Role.VIEWER: _as_viewer, Role.OPERATOR: _as_operator, Role.ADMIN: _as_admin}
    with _session(browser, world) as http:
        acts[role](world, browser, http, _form_token(browser))
    _shot(browser, f"{role.value}-after-action")


def _as_viewer(world: World, browser: Any, http: httpx.Client, csrf: str) -> None:
    echo = world.workers["echo"]
    refused = http.post(f"/console/workers/{echo}/stop", data={"csrf": csrf})
    assert refused.status_code == 403 and "needs operator" in refused.text
    manager = WorkManager(world.settings)
    assert manager.get_worker(echo).status == "running"

    def finished() -> Any:  # the entry is completed once the answer has gone
        found = [a for a in manager.audit.list() if a.path.startswith("/console/workers/")]
        return len(found) == 1 and found[0].status_code is not None and found[0]

    entry = eventually(finished)
    assert (entry.token_name, entry.status_code) == ("console-viewer", 403), entry
    assert entry.action == f"POST /console/workers/{{ref}}/{{action}} ref={echo} action=stop"


def _as_operator(world: World, browser: Any, http: httpx.Client, csrf: str) -> None:
    manager, echo, first = WorkManager(world.settings), world.workers["echo"], world.letters[0]
    [schedule] = manager.list_schedules()
    _press(browser, f"action-remove-{schedule.id[:8]}")
    assert "Schedule removed." in _text(browser, "done")
    assert manager.list_schedules() == []
    browser.get(f"{world.url}/console/deadletters/{first}")
    _press(browser, "action-replay")
    assert "sent back" in _text(browser, "done")
    assert manager.dead_letters.get(first).replay_count == 1
    try:  # sent to the same failing code, it is parked again by the node
        eventually(lambda: len(manager.dead_letters.list()) == 2)
    except AssertionError:
        print(world.node.tail(80), manager.dead_letters.list(include_replayed=True))
        raise
    refused = http.post(f"/console/deadletters/{world.letters[1]}/purge", data={"csrf": csrf})
    assert refused.status_code == 403 and "needs admin" in refused.text
    assert len(manager.dead_letters.list()) == 2
    browser.get(f"{world.url}/console/workers/{echo}")
    _press(browser, "action-stop")
    assert _text(browser, "status") == "stopped" and "stopped" in _text(browser, "done")
    assert manager.get_worker(echo).status == "stopped"


def _as_admin(world: World, browser: Any, http: httpx.Client, csrf: str) -> None:
    manager, idle = WorkManager(world.settings), world.workers["idle"]
    browser.get(f"{world.url}/console/deadletters/{world.letters[0]}")
    _press(browser, "action-purge")
    assert _rows(browser, "letters")[0][0] == world.letters[1][:8]
    assert [d.id for d in manager.dead_letters.list()] == [world.letters[1]]
    browser.get(f"{world.url}/console/workers/{idle}")
    _press(browser, "action-delete")
    assert "deleted" in _text(browser, "done")
    assert manager.get_worker(idle).status == "deleted"


def test_a_tenants_token_sees_its_tenant_only(world: World, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _login(browser, world, world.secrets["acme"], tenant="default")
    assert "works in tenant 'acme' only" in _text(browser, "error")  # it may not choose
    assert browser.find_element(By.ID, "tenant-name").get_attribute("value") == "default"
    browser.find_element(By.ID, "tenant-name").clear()
    browser.find_element(By.ID, "token").send_keys(world.secrets["acme"])
    _press(browser, "login")
    assert _text(browser, "tenant") == "acme"
    assert [row[0] for row in _rows(browser, "workers")] == ["acme-echo"]
    _shot(browser, "acme-workers")
    echo = world.workers["echo"]
    browser.get(f"{world.url}/console/workers/{echo}")
    assert _text(browser, "error") == f"no worker with id {echo}"  # as a missing one
    browser.get(f"{world.url}/console/deadletters")
    assert _ids(browser, "#no-letters") == {"no-letters"}
    with _session(browser, world) as http:
        csrf = _form_token(browser)
        other = http.post(f"/console/workers/{echo}/stop", data={"csrf": csrf})
        assert other.status_code == 404, other.text
    assert WorkManager(world.settings).get_worker(echo).status == "running"
    browser.get(f"{world.url}/console/workers/{world.workers['acme-echo']}")
    _press(browser, "action-suspend")
    assert _text(browser, "status") == "suspended"
    acme = WorkManager(world.settings, tenant="acme")
    assert acme.get_worker(world.workers["acme-echo"]).status == "suspended"
    _shot(browser, "acme-worker")


def test_login_logout_and_forms_from_elsewhere(world: World, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _login(browser, world, "wm_forged_token")
    assert "unknown, revoked or expired" in _text(browser, "error")
    _shot(browser, "login-refused")
    _, revoked = Tokens(world.settings).create("short-lived", Role.OPERATOR)
    browser.find_element(By.ID, "token").send_keys(revoked)
    _press(browser, "login")
    assert _text(browser, "role") == "operator"
    echo = world.workers["echo"]
    with _session(browser, world) as http:
        no_form_token = http.post(f"/console/workers/{echo}/stop", data={"csrf": "x" * 64})
        assert no_form_token.status_code == 403 and "reload" in no_form_token.text
        assert WorkManager(world.settings).get_worker(echo).status == "running"
    Tokens(world.settings).revoke("short-lived")
    browser.get(f"{world.url}/console/schedules")  # the gate sends it back, saying why
    assert browser.current_url == f"{world.url}/console/login?expired=1"
    assert "revoked or expired" in _text(browser, "error")
    assert browser.get_cookie("wm_console") is None
    _login(browser, world, world.secrets["viewer"])
    _press(browser, "logout")
    assert browser.current_url == f"{world.url}/console/login"
    browser.get(f"{world.url}/console/")
    assert browser.current_url == f"{world.url}/console/login"


def test_pages_load_nothing_from_elsewhere_and_refuse_framing(world: World) -> None:
    """Without a session every page but login is a redirect to it; the login page loads
    its own style sheet only, and forbids framing and foreign scripts."""
    page = httpx.get(f"{world.url}/console/login")
    assert page.status_code == 200
    loads = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert all(a.startswith("/console/") for a in loads), loads
    assert "<script" not in page.text
    assert page.headers["x-frame-options"] == "DENY"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    css = httpx.get(f"{world.url}/console/static/console.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    for path in ("/console/", f"/console/workers/{world.workers['echo']}", "/console/schedules"):
        reply = httpx.get(f"{world.url}{path}")
        assert reply.status_code == 303 and reply.headers["location"] == "/console/login", path
    entry = httpx.get(f"{world.url}/console")
    assert entry.status_code == 307 and entry.headers["location"] == "/console/"
    bearer = {"Authorization": f"Bearer {world.secrets['viewer']}"}  # the cookie only opens it
    assert httpx.get(f"{world.url}/console/", headers=bearer).status_code == 303


def test_each_action_needs_the_role_of_the_json_route_it_mirrors() -> None:
    from tests.test_api import NEEDS
    from wm.ops import api
    from wm.ops.console import pages

    routers = (api.WORKERS, api.LETTERS, api.SCHEDULES)
    assert pages.roles_of(routers) == {a: NEEDS[r] for a, r in pages.ACTIONS.items()}
    with pytest.raises(RuntimeError, match="console action start"):
        pages.roles_of((api.LETTERS,))
