"""Documentation pages that work offline: the Scalar reference at `/` and Swagger UI at `/docs`,
with their JavaScript and CSS served from this package (vendored from npm, licences beside them)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"

# Both pages carry an empty inline icon: without one the browser asks for /favicon.ico and logs
# the 404 as a console error.
_SCALAR = """<!doctype html>
<html><head><meta charset="utf-8"><title>openjev API reference</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"></head>
<body><div id="app"></div>
<script src="/static/scalar/standalone.js"></script>
<script>Scalar.createApiReference('#app', %s);</script>
</body></html>"""

_SWAGGER = """<!doctype html>
<html><head><meta charset="utf-8"><title>openjev: Swagger UI</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/static/swagger-ui/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/static/swagger-ui/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: '/openapi.json', dom_id: '#swagger-ui', tryItOutEnabled: true});</script>
</body></html>"""

SCALAR_CONFIG = {
    "url": "/openapi.json",
    "withDefaultFonts": False,  # the default fonts come from a CDN; the page must work offline
    "hideClientButton": False,
    "telemetry": False,
    "agent": {"disabled": True},
    "mcp": {"disabled": True},
    "showDeveloperTools": "never",  # its Share and Deploy menus talk to scalar.com; nothing to offer self-hosted
}


def install_docs(app: FastAPI) -> None:
    """Serve the vendored assets and the two documentation pages."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def reference() -> HTMLResponse:
        return HTMLResponse(_SCALAR % json.dumps(SCALAR_CONFIG))

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return HTMLResponse(_SWAGGER)
