"""The admin API's own documentation pages, served with no network: ``/docs`` (Swagger UI)
and ``/redoc`` (ReDoc).

FastAPI's built-in pages load their scripts and styles from a CDN, so without internet
access ``/docs`` is a blank page. These are the same pages (FastAPI's
``get_swagger_ui_html`` and ``get_redoc_html``) pointed at copies the API serves itself,
under :data:`ASSETS`: the files that the ``fastapi-offline`` package ships (part of the
``[api]`` extra), so upgrading that package upgrades Swagger UI and ReDoc. ReDoc's Google
fonts are left out (it falls back to the browser's).

The pages and the files answer without a token, as FastAPI's own pages did: they hold
nothing but the API's description, which ``/openapi.json`` gives anyone.
"""

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

#: Where the pages' scripts, styles and icon are served (a mount: every path under it is a
#: file of the package or a 404, never another route).
ASSETS = "/docs/assets"
DOCS, REDOC, OAUTH2_REDIRECT = "/docs", "/redoc", "/docs/oauth2-redirect"


def _asset_directory() -> str:
    """The folder of Swagger UI's and ReDoc's files inside the installed package."""
    return str(resources.files("fastapi_offline") / "static")


def add_docs(app: FastAPI) -> frozenset[str]:
    """Add ``/docs``, its OAuth2 redirect page, ``/redoc`` and :data:`ASSETS` to ``app``
    (made with ``docs_url=None, redoc_url=None``); the paths that need no token are
    returned (the mount's as a prefix ending in ``/``)."""
    app.mount(ASSETS, StaticFiles(directory=_asset_directory()), name="docs-assets")

    def under_root(request: Request, path: str) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/") + path

    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=under_root(request, str(app.openapi_url)),
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=under_root(request, OAUTH2_REDIRECT),
            swagger_js_url=under_root(request, f"{ASSETS}/swagger-ui-bundle.js"),
            swagger_css_url=under_root(request, f"{ASSETS}/swagger-ui.css"),
            swagger_favicon_url=under_root(request, f"{ASSETS}/favicon.png"),
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=under_root(request, str(app.openapi_url)),
            title=f"{app.title} - ReDoc",
            redoc_js_url=under_root(request, f"{ASSETS}/redoc.standalone.js"),
            redoc_favicon_url=under_root(request, f"{ASSETS}/favicon.png"),
            with_google_fonts=False,
        )

    for path, page in ((DOCS, swagger_ui), (OAUTH2_REDIRECT, oauth2_redirect), (REDOC, redoc)):
        app.add_route(path, page, include_in_schema=False)
    return frozenset({DOCS, OAUTH2_REDIRECT, REDOC, f"{ASSETS}/"})
