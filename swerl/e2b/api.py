"""The E2B control API (REST, `E2B_API_URL`): sandboxes as pool leases.

Routes are those of E2B's API the SDK calls for create, connect, kill, list, set-timeout,
get-info and snapshots; any other route answers 501 naming the call. Errors have E2B's body
(`{"code": <status>, "message": ...}`), which the SDK turns into its exceptions by status.
"""

from __future__ import annotations

import hmac
import json
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from swerl.e2b.sandboxes import ApiError, SandboxRegistry

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REGISTRY_KEY: web.AppKey[SandboxRegistry] = web.AppKey("registry", SandboxRegistry)
API_KEY_KEY: web.AppKey[str] = web.AppKey("api_key", str)


def error_response(status: int, message: str) -> web.Response:
    response = web.json_response({"code": status, "message": message}, status=status)
    # The SDK retries 429/502/503/504 unless told not to; only a full pool is worth it.
    response.headers["Should-Retry"] = "true" if status == 429 else "false"
    return response


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    expected = request.app[API_KEY_KEY]
    if expected:
        given = request.headers.get("X-API-KEY", "")
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return error_response(401, "Invalid API key")
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
        return error_response(
            501, f"{request.method} {request.path} is not implemented by swerl's E2B face"
        )


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def create(request: web.Request) -> web.Response:
    sandbox = await request.app[REGISTRY_KEY].create(await _json(request))
    return web.json_response(sandbox.created(), status=201)


async def connect(request: web.Request) -> web.Response:
    body = await _json(request)
    sandbox = request.app[REGISTRY_KEY].connect(request.match_info["id"], body.get("timeout"))
    return web.json_response(sandbox.created(), status=200)


async def get_info(request: web.Request) -> web.Response:
    sandbox = request.app[REGISTRY_KEY].get(request.match_info["id"])
    detail = sandbox.summary() | {"envdAccessToken": sandbox.access_token}
    return web.json_response(detail)


async def kill(request: web.Request) -> web.Response:
    sandbox_id = request.match_info["id"]
    if not await request.app[REGISTRY_KEY].kill(sandbox_id):
        raise ApiError(404, f"sandbox {sandbox_id} not found")
    return web.Response(status=204)


async def set_timeout(request: web.Request) -> web.Response:
    body = await _json(request)
    request.app[REGISTRY_KEY].set_timeout(request.match_info["id"], body.get("timeout"))
    return web.Response(status=204)


async def list_sandboxes(request: web.Request) -> web.Response:
    metadata: dict[str, str] = {}
    raw = request.query.get("metadata", "")
    for key, value in urllib.parse.parse_qsl(raw, keep_blank_values=True):
        metadata[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
    states = {s for s in request.query.get("state", "").split(",") if s}
    listed = request.app[REGISTRY_KEY].list(metadata, states)
    return web.json_response([s.summary() for s in listed])


async def create_snapshot(request: web.Request) -> web.Response:
    body = await _json(request)
    snapshot = await request.app[REGISTRY_KEY].snapshot(request.match_info["id"], body)
    names = [body["name"]] if isinstance(body.get("name"), str) else []
    return web.json_response({"snapshotID": snapshot.snapshot_id, "names": names}, status=201)


async def delete_template(request: web.Request) -> web.Response:
    template_id = request.match_info["id"]
    if not await request.app[REGISTRY_KEY].delete_snapshot(template_id):
        raise ApiError(404, f"snapshot {template_id} not found")
    return web.Response(status=204)


async def template_alias(request: web.Request) -> web.Response:
    """A template "exists" when the face maps it to an image (`templates`), or it is a
    snapshot; a template build is not implemented, so an unknown one is 404."""
    alias = request.match_info["alias"]
    registry = request.app[REGISTRY_KEY]
    if alias not in registry.settings.templates and alias not in registry.snapshots:
        raise ApiError(404, f"template {alias} not found")
    return web.json_response({"templateID": alias, "public": False})


def make_api_app(registry: SandboxRegistry, api_key: str) -> web.Application:
    """The control API; an empty `api_key` accepts every caller (--insecure)."""
    app = web.Application(middlewares=[api_errors])
    app[REGISTRY_KEY] = registry
    app[API_KEY_KEY] = api_key
    for prefix in ("", "/v2"):
        app.router.add_post(f"{prefix}/sandboxes", create)
        app.router.add_get(f"{prefix}/sandboxes", list_sandboxes)
        app.router.add_post(f"{prefix}/sandboxes/{{id}}/connect", connect)
    app.router.add_get("/sandboxes/{id}", get_info)
    app.router.add_delete("/sandboxes/{id}", kill)
    app.router.add_post("/sandboxes/{id}/timeout", set_timeout)
    app.router.add_post("/sandboxes/{id}/snapshots", create_snapshot)
    app.router.add_delete("/templates/{id}", delete_template)
    app.router.add_get("/templates/aliases/{alias}", template_alias)
    return app
