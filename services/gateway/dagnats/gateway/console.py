"""The web console at ``/ui``: plain HTML, CSS and ES modules from ``ui/``,
with no build step.

The files hold no data and no secret, so they are served without a token;
everything the console shows comes from the API, with the API token the
console asks for and keeps in the tab's session storage. Only the files in
``ui/`` are served (by name, so no path leaves the folder), with a content
security policy that lets a page load scripts, styles and data from this
gateway only and no inline script: what a run, a tool or a model wrote is
shown as text, and even markup that slipped into the page could not run.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from dagnats.core.errors import NotFound

router = APIRouter(include_in_schema=False)

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Checked again on each load: a new gateway's console is seen at once.
    "Cache-Control": "no-cache",
}


_FOLDER = resources.files("dagnats.gateway") / "ui"
# The files served, by name; each is read when asked for (a few KiB).
FILES = {
    entry.name: _TYPES["." + entry.name.rpartition(".")[2]]
    for entry in _FOLDER.iterdir()
    if entry.is_file() and "." + entry.name.rpartition(".")[2] in _TYPES
}


@router.get("/ui")
async def console_root() -> Response:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/")
async def console_page() -> Response:
    return _serve("index.html")


@router.get("/ui/{name}")
async def console_file(name: str) -> Response:
    return _serve(name)


def _serve(name: str) -> Response:
    media_type = FILES.get(name)
    if media_type is None:
        raise NotFound(f"the console has no file {name!r}", field="name")
    body = (_FOLDER / name).read_bytes()
    return Response(body, media_type=media_type, headers=_HEADERS)
