"""``wm db``, ``wm config``, ``wm health``, ``wm bench``, ``wm completion``, ``wm token``,
``wm audit`` and ``wm schedule`` as an operator runs them: real processes against real Redis,
SQLite and PostgreSQL, tables in a pseudo-terminal."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_env import one_error_line, wm, wm_json
from tests.helpers import Exchange, free_port, http_server, plain, run_in_terminal
from tests.test_cli import create
from wm import Settings, store
from wm.config import deployment_name, settings_table

WM = [sys.executable, "-m", "wm.cli"]
#: A narrow terminal: every table must still fit it.
NARROW_COLUMNS = 60
WIDE_COLUMNS = 200
BOTH_DATABASES = pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)


# -- wm db, wm config ----------------------------------------------------------------------------


def test_db_upgrade_then_current(unmigrated_env: dict[str, str]) -> None:
    before = wm_json(unmigrated_env, "db", "current")
    assert before["current"] is None and before["up_to_date"] is False
    assert "never migrated: run wm db upgrade" in wm(unmigrated_env, "db", "current").out
    upgraded = wm_json(unmigrated_env, "db", "upgrade")
    after = wm(unmigrated_env, "db", "current", "--json").out  # --json after the command too
    assert json.loads(after) == {
        "current": upgraded["current"],
        "head": upgraded["current"],
        "up_to_date": True,
    }
    assert (
        wm(unmigrated_env, "db", "upgrade").out == f"database at revision {upgraded['current']}\n"
    )
    assert "up to date" in wm(unmigrated_env, "db", "current").out


def _with_password(env: dict[str, str]) -> dict[str, str]:
    """The broker URL with a password in it (``wm config`` connects to nothing)."""
    return {**env, "WM_BROKER_URL": "redis://operator:s3cret@127.0.0.1:1/0"}


def test_config_json_lists_every_setting_with_passwords_masked(env: dict[str, str]) -> None:
    rows = {r["variable"]: r for r in wm_json(_with_password(env), "config")}
    assert set(rows) == {variable for variable, _, _ in settings_table()}
    assert set(rows["WM_BROKER_URL"]) == {"variable", "default", "current", "meaning"}
    assert rows["WM_BROKER_URL"]["current"] == "redis://operator:**@127.0.0.1:1/0"
    assert rows["WM_DATABASE_URL"]["current"] == env["WM_DATABASE_URL"]
    # a derived deployment name is shown in parentheses
    assert rows["WM_DEPLOYMENT"]["current"] == f"({deployment_name(Settings.from_env(env))})"


def test_config_table_wraps_to_a_narrow_terminal(env: dict[str, str]) -> None:
    shown = run_in_terminal([*WM, "config"], _with_password(env), columns=NARROW_COLUMNS)
    assert shown.code == 0, shown.screen
    screen = plain(shown.screen)
    lines = screen.splitlines()
    assert lines[0].split() == ["VARIABLE", "DEFAULT", "CURRENT", "MEANING"]
    assert max(map(len, lines)) <= NARROW_COLUMNS
    assert "s3cret" not in screen
    # every meaning is there whole, folded over several lines of its column
    meaning = dict((v, m) for v, _, m in settings_table())["WM_DATABASE_URL"]
    assert all(word in screen for word in meaning.split())
    assert len(lines) > 2 * len(settings_table())


def test_config_table_keeps_names_whole_on_a_wide_terminal(env: dict[str, str]) -> None:
    shown = run_in_terminal([*WM, "config"], env, columns=WIDE_COLUMNS)
    assert shown.code == 0, shown.screen
    lines = plain(shown.screen).splitlines()
    assert max(map(len, lines)) <= WIDE_COLUMNS
    first_cells = {line.split()[0] for line in lines[2:] if line[:1].strip()}
    assert first_cells == {variable for variable, _, _ in settings_table()}


# -- wm health -----------------------------------------------------------------------------------


@contextlib.contextmanager
def health_endpoint(report: dict[str, Any]) -> Iterator[str]:
    """A node's health endpoint answering ``report`` (503 unless healthy); yields its URL."""

    def health(exchange: Exchange) -> None:
        exchange.reply_json(report, 200 if report["status"] == "healthy" else 503)

    with http_server(health) as server:
        yield server.url("/health")


def _report(status: str) -> dict[str, Any]:
    redis_ok = status == "healthy"
    return {
        "node": "node-a",
        "status": status,
        "checks": {"broker": {"ok": True}, "redis": {"ok": redis_ok, "error": "refused"}},
        "recovery": {"state": "idle"},
        "consuming": True,
        "engines": {"text/x-python": {"sandbox_layers": ["user namespace"], "sandbox_missing": []}},
        "reasons": [] if redis_ok else ["redis unreachable"],
    }


@pytest.mark.parametrize(("status", "code"), [("healthy", 0), ("degraded", 1), ("unhealthy", 2)])
def test_health_exit_code_and_fields(env: dict[str, str], status: str, code: int) -> None:
    with health_endpoint(_report(status)) as url:
        shown = wm(env, "health", "--node", url, expect=code).out
        assert json.loads(wm(env, "health", "--node", url, "--json", expect=code).out) == (
            _report(status)
        )
    pairs = [line.split(":", 1) for line in shown.splitlines() if not line.startswith("- ")]
    fields = {key: value.strip() for key, value in pairs}
    assert fields["status"] == status and fields["node"] == "node-a"
    assert fields["redis"] == ("ok" if code == 0 else "FAILED: refused")
    assert fields["text/x-python"] == "sandbox layers: user namespace; sandbox missing: none"
    assert ("- redis unreachable" in shown) is (code != 0)


def test_health_without_a_node_says_what_to_pass(env: dict[str, str]) -> None:
    """Not asked is neither healthy nor unhealthy: exit 3, a monitor's UNKNOWN."""
    result = wm({**env, "WM_HEALTH_PORT": "0"}, "health", expect=3)
    assert "pass --node URL, or set WM_HEALTH_PORT" in one_error_line(result)
    gone = f"127.0.0.1:{free_port()}"
    line = one_error_line(wm(env, "health", "--node", gone, expect=3))
    assert line.startswith(f"wm: error: no health answer from http://{gone}/health: "), line


@pytest.mark.parametrize("form", ["{host}:{port}", "http://{host}:{port}"])
def test_health_takes_host_and_port_alone(env: dict[str, str], form: str) -> None:
    with health_endpoint(_report("degraded")) as url:
        parts = urllib.parse.urlsplit(url)
        node = form.format(host=parts.hostname, port=parts.port)
        assert json.loads(wm(env, "health", "--node", node, "--json", expect=1).out) == (
            _report("degraded")
        )


# -- wm bench, wm up, wm completion --------------------------------------------------------------


def test_bench_gets_every_argument_help_included(env: dict[str, str]) -> None:
    shown = wm(env, "bench", "--help").out
    assert shown.startswith("usage: wm bench [-h]")  # argparse's, not click's
    assert "--drain-repeats" in shown
    assert wm(env, "bench", "--json", "-h").out == shown
    refused = wm(env, "bench", "--no-such-option", expect=2)
    assert "wm bench: error: unrecognized arguments: --no-such-option" in refused.err


def test_option_help_shows_defaults(env: dict[str, str]) -> None:
    shown = " ".join(wm(env, "up", "--help").out.split())
    assert "[default: prefork]" in shown and "[default: 2; x>=1]" in shown
    shown = " ".join(wm(env, "schedule", "add", "--help").out.split())
    assert "[default: UTC]" in shown and "[default: 10; x>=1]" in shown
    assert "[default: 50; x>=1]" in " ".join(wm(env, "audit", "--help").out.split())


def test_completion_scripts(env: dict[str, str]) -> None:
    bash = wm(env, "completion", "bash").out
    assert "_WM_COMPLETE=bash_complete" in bash
    assert "complete -o nosort -F _wm_completion wm" in bash
    assert wm(env, "completion", "zsh").out.startswith("#compdef wm")
    assert "complete --no-files --command wm" in wm(env, "completion", "fish").out
    assert wm({**env, "SHELL": "/usr/bin/zsh"}, "completion").out.startswith("#compdef wm")
    assert wm_json(env, "completion", "bash") == {"shell": "bash", "script": bash}
    assert "'tcsh' is not one of" in wm(env, "completion", "tcsh", expect=2).err


def _complete(env: dict[str, str], words: str) -> list[str]:
    """What ``wm`` offers for the last of ``words``, asked the way the bash script asks."""
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    asked = {**env, "_WM_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    return wm(asked).out.split()


def test_completion_offers_commands_and_choices(env: dict[str, str]) -> None:
    assert _complete(env, "wm wor") == ["plain,worker"]
    assert _complete(env, "wm schedule ") == ["plain,add", "plain,list", "plain,remove"]
    assert _complete(env, "wm token create --role op") == ["plain,operator"]


def test_completion_in_bash(env: dict[str, str]) -> None:
    """The script ``wm completion bash`` prints, sourced in a real bash, completes ``wm``."""
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed for this test"
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "wm").exists(), "the wm script of this environment"
    script = wm(env, "completion", "bash").out
    asked = f'{script}\nCOMP_WORDS=(wm db "") COMP_CWORD=2\n_wm_completion wm\n'
    asked += 'echo "${COMPREPLY[@]}"\n'
    done = subprocess.run(
        [bash, "--norc", "--noprofile"],
        input=asked,
        env={**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.split() == ["upgrade", "current"], done.stderr


# -- wm token, wm audit --------------------------------------------------------------------------


@BOTH_DATABASES
def test_tokens_create_list_revoke(env: dict[str, str]) -> None:
    made = wm_json(
        env, "token", "create", "--name", "ci", "--role", "viewer", "--expires-days", "2"
    )
    assert made["token"].startswith(f"wm_{made['id']}_") and made["role"] == "viewer"
    shown = wm(env, "token", "create", "--name", "deploy", "--role", "operator")
    fields = dict(line.split(":", 1) for line in shown.out.splitlines())
    assert fields["name"].strip() == "deploy" and fields["expires"].strip() == "never"
    assert fields["token"].strip().startswith(f"wm_{fields['id'].strip()}_")
    assert "shown once" in shown.err
    table = wm(env, "token", "list").out.splitlines()
    assert table[0].split()[:3] == ["ID", "NAME", "ROLE"]
    assert table[1].split()[:3] == [made["id"], "ci", "viewer"]
    assert made["token"] not in "\n".join(table)

    assert wm(env, "token", "revoke", "ci").out == f"revoked token ci ({made['id']})\n"
    assert [t["name"] for t in wm_json(env, "token", "list")] == ["deploy"]
    listed = wm_json(env, "token", "list", "--all")
    assert [t["name"] for t in listed] == ["ci", "deploy"] and listed[0]["revoked_at"]
    assert "token" not in listed[0]
    assert "a token named 'deploy' is in force" in one_error_line(
        wm(env, "token", "create", "--name", "deploy", "--role", "admin", expect=1)
    )
    assert (
        "'root' is not one of"
        in wm(env, "token", "create", "--name", "x", "--role", "root", expect=2).err
    )


def test_audit_names_the_token_and_the_worker(env: dict[str, str], tmp_path: Path) -> None:
    from wm.control.access import Audit, Tokens

    worker = create(env, tmp_path, "--name", "shouter", "--no-start")["id"]
    settings = Settings.from_env(env)
    token, _ = Tokens(settings).create("deploy", "operator")
    audit = Audit(settings)
    for path, action in (
        (f"/v1/workers/{worker}/stop", f"POST /v1/workers/{{ref}}/stop ref={worker}"),
        ("/v1/workers/shouter/start", "POST /v1/workers/{ref}/start ref=shouter"),
    ):
        entry = audit.begin("POST", path, "127.0.0.1")
        audit.finish(
            entry, token=token, action=action, status_code=200, result="ok", duration_ms=1.0
        )
    audit.begin("DELETE", "/v1/workers/gone", "127.0.0.1")  # still running: unfinished
    store.dispose_engines()

    table = wm(env, "audit").out.splitlines()
    assert table[0].split() == ["AT", "TOKEN", "ROLE", "FROM", "CALL", "STATUS", "RESULT"]
    assert f"deploy ({token.id})" in table[1]
    assert f"stop ref=shouter ({worker})" in table[1]
    assert "start ref=shouter " in table[2]
    assert "DELETE /v1/workers/gone" in table[3] and "unfinished" in table[3]
    entries = wm_json(env, "audit", "--token", "deploy", "--limit", "1")
    assert [e["action"] for e in entries] == ["POST /v1/workers/{ref}/start ref=shouter"]
    assert wm_json(env, "audit", "--since", "2999-01-01") == []
    assert "not an ISO 8601 time" in wm(env, "audit", "--since", "soon", expect=2).err


# -- wm schedule ---------------------------------------------------------------------------------


@BOTH_DATABASES
def test_schedules_add_list_remove_with_names(env: dict[str, str], tmp_path: Path) -> None:
    worker = create(env, tmp_path, "--name", "shouter", "--no-start")["id"]
    every = wm_json(
        env, "schedule", "add", "shouter", "--every", "30", "--type", "tick", "--data", '{"n": 1}'
    )
    assert every["worker_id"] == worker and every["data"] == {"n": 1} and every["every_s"] == 30
    said = wm(
        env,
        "schedule",
        "add",
        worker,
        "--cron",
        "0 9 * * 1-5",
        "--tz",
        "Europe/Oslo",
        "--type",
        "tock",
    ).out
    assert said.startswith("schedule ") and f"for worker shouter ({worker}): next firing " in said

    shown = run_in_terminal([*WM, "schedule", "list"], env, columns=WIDE_COLUMNS)
    assert shown.code == 0, shown.screen
    rows = plain(shown.screen).splitlines()
    assert rows[0].split() == ["ID", "WORKER", "WHEN", "TYPE", "MISSED", "LAST", "NEXT"]
    assert f"shouter ({worker})" in rows[2] and "every 30 s" in rows[2]
    assert "cron 0 9 * * 1-5 (Europe/Oslo)" in rows[3]
    listed = wm_json(env, "schedule", "list", "--worker", "shouter")
    assert [s["event_type"] for s in listed] == ["tick", "tock"]

    assert (
        wm(env, "schedule", "remove", every["id"][:8]).out
        == f"removed schedule {every['id'][:8]}\n"
    )
    assert [s["event_type"] for s in wm_json(env, "schedule", "list")] == ["tock"]
    assert wm_json(env, "schedule", "remove", listed[1]["id"]) == {"removed": listed[1]["id"]}
    assert wm(env, "schedule", "list").out == "no schedules\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--type", "t"], "give exactly one of --cron, --every"),
        (["--type", "t", "--every", "5", "--cron", "* * * * *"], "give exactly one of --cron"),
        (["--type", "t", "--every", "0"], "not in the range x>0"),
        (["--type", "t", "--every", "5", "--data", "{"], "--data is not JSON"),
        (["--type", "t", "--every", "5", "--missed", "all"], "'all' is not one of"),
        (["--type", "t", "--every", "5", "--until", "later"], "not an ISO 8601 time"),
    ],
)
def test_schedule_usage_errors_exit_2(env: dict[str, str], args: list[str], message: str) -> None:
    refused = wm(env, "schedule", "add", "w", *args, expect=2)
    assert refused.err.startswith("Usage: wm schedule add") and message in refused.err


def test_schedule_constants_agree_with_their_sources() -> None:
    from wm.cli import schedules
    from wm.control.schedules import DEFAULT_MAX_CATCH_UP
    from wm.schedules import MISSED

    assert schedules.MISSED == MISSED
    assert schedules.DEFAULT_MAX_CATCH_UP == DEFAULT_MAX_CATCH_UP


def test_api_refuses_json_rather_than_ignoring_it(env: dict[str, str]) -> None:
    assert "No such option '--json'" in wm(env, "api", "--json", expect=2).err
    assert "WM_LOG_FORMAT=json" in wm(env, "--json", "api", expect=2).err


# -- newcomer's traps (issue 29, point 11) ----------------------------------------------------

MISSPELT = (
    "wm: warning: PYTHON_ALLOWED_PACKAGE is no WorkManager setting and is ignored: did you "
    "mean PYTHON_ALLOWED_PACKAGES?"
)


def test_config_warns_of_a_misspelt_unprefixed_setting(env: dict[str, str]) -> None:
    result = wm({**env, "PYTHON_ALLOWED_PACKAGE": "numpy"}, "config")
    assert result.err.splitlines() == [MISSPELT]
    assert wm({**env, "PYTHONPATH": ""}, "config").err == ""  # a near name is no misspelling


def test_a_node_warns_of_a_misspelt_unprefixed_setting(
    pg_settings: Settings, start_node: Any
) -> None:
    node = start_node(pg_settings, MESSAGE_HANDLING_TIMEOUT_SECOND="5")
    node.wait_for(
        "MESSAGE_HANDLING_TIMEOUT_SECOND is no WorkManager setting and is ignored: did you "
        "mean MESSAGE_HANDLING_TIMEOUT_SECONDS?"
    )


def test_install_hints_name_the_checkout_when_run_from_one(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``pip install 'workmanager[api]'`` would fetch PyPI's copy, not install the clone's
    extra. A package that raises ModuleNotFoundError stands in for an absent fastapi."""
    absent = tmp_path / "absent" / "fastapi"
    absent.mkdir(parents=True)
    (absent / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n"
    )
    result = wm({**env, "PYTHONPATH": str(absent.parent)}, "api", expect=1)
    assert one_error_line(result).endswith(
        "needs the [api] extra (module 'fastapi' is missing): pip install -e '.[api]'"
    )
    root = Path(__file__).resolve().parent.parent
    elsewhere = subprocess.run(
        [sys.executable, "-c", "from wm.extras import install_hint; print(install_hint('x'))"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert elsewhere.stdout == f"pip install -e '{root}[x]'\n"


def test_every_install_hint_comes_from_one_place() -> None:
    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("wm/**/*.py"), *root.glob("engines/**/*.py")]
    found = [p for p in sources if "pip install 'workmanager[" in p.read_text()]
    assert found == [root / "wm" / "extras.py"]
