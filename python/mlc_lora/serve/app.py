"""The OpenAI-compatible HTTP API over one AsyncMLCEngine (FastAPI).

Responses are the engine's own (engine/responses.py), renamed to the model the request asked for.
A client that goes away cancels its engine call (the stream, or the task awaiting a whole
response), which aborts the request's sequences and frees their pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import errors
from ..engine.protocol import ChatCompletionRequest, CompletionRequest
from ..engine.adapters import check_adapter_name
from .adapters import AdapterRoots
from .metrics import Metrics

STATS_INTERVAL_S = 1.0
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a request body past this is refused (413) before it is read whole
DRAIN_TIMEOUT_S = 3.0  # on SIGTERM, running requests get this long to finish before they are aborted
log = logging.getLogger("mlc_lora.serve")


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        # a lone surrogate from the request (an unknown model's name) would make the body unencodable
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(e: BaseException) -> APIError:
    """The HTTP status and body of an exception raised while serving a request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, errors.UnknownAdapterError):  # a request for an adapter that is not loaded
        return APIError(404, str(e), "not_found_error", "model_not_found")
    if isinstance(e, errors.RequestError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, errors.LoraError):
        return APIError(400, str(e))
    if isinstance(e, errors.PoolExhaustedError):
        return APIError(503, str(e), "server_error", "pool_exhausted")
    if isinstance(e, errors.MLCLoraError):
        return APIError(500, str(e), "server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def _sse(obj: dict[str, Any]) -> str:
    # allow_nan=False: a NaN would be invalid JSON; it raises here and becomes an error event
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that stop (cancelling the generator) as soon as the client disconnects.

    Starlette only notices a disconnect on the next write under ASGI 2.4; a request still queued
    or prefilling writes nothing for a while, so listen for it the whole time."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        # cancelled mid-send, the generator sits at a yield: close it now (its finally aborts the
        # request) rather than whenever it is garbage-collected
        await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# Routes the API key guards: /v1/* always; with guard_all also these (never /health, for probes).
GUARDED_WITH_ALL = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


SHUTTING_DOWN = APIError(503, "the server is shutting down; retry on another replica", "server_error",
                         "server_shutting_down")


def check_api_key(api_key: Optional[str]) -> Optional[str]:
    """`api_key` itself (None: no authentication); an empty or blank key is refused, never taken
    to mean the key ""."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise errors.MLCLoraError("the API key is empty (--api-key or MLC_LORA_API_KEY): give a "
                                  "non-empty key, or leave both unset to serve without authentication")
    return api_key


class Server:  # pylint: disable=too-many-instance-attributes
    """State shared by the routes: the engine, the names it answers to, adapter roots, metrics.
    `api_key` guards /v1/*; `guard_all` also /metrics, /docs, /redoc and /openapi.json."""

    def __init__(self, engine, model_name: str, model_dir: str | Path = "",
                 adapter_roots: Optional[AdapterRoots] = None, api_key: Optional[str] = None,
                 guard_all: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S):
        self.engine = engine
        self.model_name = model_name
        self.model_dir = str(model_dir)
        self.roots = adapter_roots or AdapterRoots([])
        self.api_key = check_api_key(api_key)
        if guard_all and api_key is None:
            raise errors.MLCLoraError("guarding every route (--api-key-all-routes) needs an API key")
        self.guard_all = guard_all
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_s = drain_timeout_s
        self.draining = False  # SIGTERM received: new requests get 503
        self.abort_all: Optional[asyncio.Event] = None  # set when the drain gives up on running requests
        self.metrics = Metrics(model_name)
        self.adapters: dict[str, str] = {}  # name -> real path, as loaded through this server
        self._first_use: dict[str, asyncio.Lock] = {}  # name -> held while it loads from disk
        self.created = int(time.time())

    # --- adapters ---------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str | Path, pin: bool = False, inplace: bool = False) -> None:
        """`inplace` (vLLM's load_inplace): a loaded adapter of that name is replaced."""
        check_adapter_name(name)  # LoraError: a 400
        if name == self.model_name:
            raise APIError(400, f"adapter name {name!r} is the base model's name", param="lora_name")
        if name in self.adapters:
            if not inplace:  # vLLM's words, which vLLM clients look for
                raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                               "the adapter in place, set 'load_inplace' to True.", param="lora_name")
            await self.engine.unload_adapter(name)
            del self.adapters[name]
        await self.engine.load_adapter(name, path, pin=pin)
        self.adapters[name] = str(path)
        self.metrics.adapter_loads.inc()

    async def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:  # vLLM's words
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error",
                           "model_not_found", "lora_name")
        await self.engine.unload_adapter(name)
        del self.adapters[name]
        self.metrics.adapter_unloads.inc()

    async def pin_adapter(self, name: str, pin: bool) -> None:
        if name not in self.adapters:
            raise APIError(404, f"no adapter named {name!r} is loaded", "not_found_error", "model_not_found",
                           "lora_name")
        await self.engine.pin_adapter(name, pin)

    async def list_adapters(self) -> list[dict[str, Any]]:
        return list(await self.engine.list_adapters())

    async def load_on_first_use(self, model: Any) -> None:
        """A request's `model` that names no loaded adapter but a folder in an --adapter-dir root
        (vLLM's resolver, LoRAX): that folder is loaded under the name, once, while concurrent
        requests for it wait. Names that are nothing on disk are left to `adapter_of` (404)."""
        if not isinstance(model, str) or model == self.model_name or model in self.adapters:
            return
        try:
            check_adapter_name(model)
        except errors.LoraError:
            return  # no adapter can have this name: adapter_of answers 404
        try:
            real = self.roots.find(model)
        except errors.LoraError as e:
            raise APIError(400, f"model {model!r}: {e}", param="model") from e
        if real is None:
            return
        lock = self._first_use.setdefault(model, asyncio.Lock())
        async with lock:
            if model not in self.adapters:
                t0 = time.perf_counter()
                await self.load_adapter(model, real)
                log.info("adapter %s loaded from %s on its first request (%.2f s)", model, real,
                         time.perf_counter() - t0)

    def adapter_of(self, model: Any) -> Optional[str]:
        """The adapter a request's `model` names (None: the base model); 404 when it names nothing."""
        if model is None or model == self.model_name:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist: serving {self.model_name!r} and the "
                       f"adapters {sorted(self.adapters)}", "not_found_error", "model_not_found", "model")

    async def stats(self) -> dict[str, Any]:
        s = await self.engine.stats()
        self.metrics.observe_engine(s)
        return s

    # --- generation -------------------------------------------------------------------------

    def prepare(self, chat: bool, body: dict[str, Any]):
        """Check `body`; returns (the model name it answers as, its create(...) and its arguments)."""
        body = dict(body)
        model = body.pop("model", None)
        adapter = self.adapter_of(model)  # every other field is checked by the request models
        for k in ("stream", "stream_options", "user"):
            body.pop(k, None)
        known = (ChatCompletionRequest if chat else CompletionRequest).model_fields
        ignored = sorted(k for k in body if k not in known)
        if ignored:  # as vLLM: unknown fields are ignored, with a warning
            log.warning("The following fields were present in the request but ignored: %s", ignored)
            for k in ignored:
                del body[k]
        creator = self.engine.chat.completions if chat else self.engine.completions
        return (model if model is not None else self.model_name), functools.partial(
            creator.create, adapter_id=adapter, **body)

    async def events(self, gen, model: str, endpoint: str, include_usage: bool, t0: float) -> AsyncIterator[str]:
        """The SSE body of a streaming request (OpenAI's: usage on its own last chunk when asked)."""
        m, outcome, first, usage, last = self.metrics, "abort", True, None, None
        stop = asyncio.ensure_future(self.abort_all.wait()) if self.abort_all is not None else None
        try:
            async for chunk in self._until_shutdown(gen, stop):
                if first:
                    m.ttft.observe(time.monotonic() - t0)
                    first = False
                chunk.model = model
                usage, chunk.usage = chunk.usage or usage, None
                last = chunk
                yield _sse(chunk.to_dict())
            if include_usage and usage is not None and last is not None:
                yield _sse({"id": last.id, "object": last.object, "created": last.created, "model": model,
                            "choices": [], "usage": usage.to_dict()})
            yield "data: [DONE]\n\n"
            outcome = "ok"
        except Exception as e:  # pylint: disable=broad-except
            # the response has started: report in-band, as vLLM does, and end the stream properly
            outcome = "error"
            yield _sse(api_error(e).body())
            yield "data: [DONE]\n\n"
        finally:
            if stop is not None:
                stop.cancel()
            await gen.aclose()
            self._finished(endpoint, outcome, usage, t0)

    @staticmethod
    async def _until_shutdown(gen, stop: Optional[asyncio.Future]) -> AsyncIterator:
        """`gen`'s chunks until `stop` (the drain gave up): then a 503 APIError (its request is
        aborted as the pending chunk is cancelled)."""
        if stop is None:
            async for chunk in gen:
                yield chunk
            return
        while True:
            nxt = asyncio.ensure_future(gen.__anext__())
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
                raise SHUTTING_DOWN
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return

    async def complete(self, create, model: str, endpoint: str, t0: float):
        """A whole response (the engine's, as MLCEngine returns it); cancelling this aborts the
        request. A request the engine refuses (RequestError) is not counted as finished."""
        outcome, usage = "abort", None
        try:
            response = await create(stream=False)
            outcome, usage = "ok", response.usage
        except errors.RequestError:
            outcome = None
            raise
        except errors.MLCLoraError:
            outcome = "error"
            raise
        finally:
            if outcome is not None:
                self._finished(endpoint, outcome, usage, t0)
        response.model = model
        return response

    def _finished(self, endpoint: str, outcome: str, usage, t0: float) -> None:
        m = self.metrics
        m.requests.labels(endpoint, outcome).inc()
        if outcome == "ok":
            m.e2e.observe(time.monotonic() - t0)
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


class BodyLimit:
    """ASGI middleware: a request body longer than `limit` bytes is answered 413 (OpenAI-style
    JSON) as soon as its Content-Length says so, or as soon as that many bytes have arrived."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = APIError(413, f"the request body is larger than the server's limit of {self.limit} bytes",
                       code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(err.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise err
            return msg

        try:
            await self.app(scope, limited, send)
        except APIError as e:
            if e is not err:
                raise
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)


def _body_schema(model) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(server: Server) -> FastAPI:
    """The FastAPI app: /v1 routes (behind the API key, if any), /health and /metrics (behind the
    key too with `server.guard_all`, as are the docs)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async def sample():  # the tokens/s gauge needs the engine's counters over time
            while True:
                with contextlib.suppress(Exception):
                    await server.stats()
                await asyncio.sleep(STATS_INTERVAL_S)

        task = asyncio.create_task(sample())
        server.abort_all = asyncio.Event()
        loop = asyncio.get_running_loop()

        def drain() -> None:
            """SIGTERM: refuse new requests (503) and give running ones drain_timeout_s to finish;
            then abort them (streams end with an error event and [DONE], others get a 503)."""
            if not server.draining:
                server.draining = True
                log.warning("SIGTERM: draining (new requests get 503; running ones get %.0f s)",
                            server.drain_timeout_s)
                loop.call_later(server.drain_timeout_s, server.abort_all.set)

        prev = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread() and callable(prev):
            def on_term(sig, frame):  # uvicorn's own handler still runs: it stops taking connections
                loop.call_soon_threadsafe(drain)
                prev(sig, frame)

            signal.signal(signal.SIGTERM, on_term)
        yield
        task.cancel()

    app = FastAPI(title="mlc-lora", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(errors.MLCLoraError)
    async def _engine_error(_request, e: errors.MLCLoraError):
        err = api_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_request, e: Exception):  # anything else: a 500, still OpenAI JSON
        err = api_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    unauthorized = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                            "invalid_request_error", "invalid_api_key")

    def authorized(request: Request) -> bool:
        if server.api_key is None:
            return True
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), server.api_key.encode())

    async def check_key(request: Request) -> None:
        if not authorized(request):
            raise unauthorized
        if server.draining:
            raise SHUTTING_DOWN

    if server.guard_all:
        @app.middleware("http")
        async def _guard_the_rest(request: Request, call_next):  # FastAPI's docs routes take no dependencies
            if request.url.path in GUARDED_WITH_ALL and not authorized(request):
                return JSONResponse(unauthorized.body(), status_code=unauthorized.status)
            return await call_next(request)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    async def generate(request: Request, chat: bool):
        t0 = time.monotonic()
        body = await _json_body(request)
        endpoint = "chat" if chat else "completions"
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise APIError(400, f"stream must be a boolean, got {json.dumps(stream)}", param="stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        await server.load_on_first_use(body.get("model"))
        model, create = server.prepare(chat, body)
        if stream:
            gen = await create(stream=True)
            include_usage = bool((opts or {}).get("include_usage"))
            return _EventStream(server.events(gen, model, endpoint, include_usage, t0))
        task = asyncio.ensure_future(server.complete(create, model, endpoint, t0))
        gone = asyncio.ensure_future(_disconnected(request))
        stop = asyncio.ensure_future(server.abort_all.wait()) if server.abort_all is not None else gone
        try:
            done, _ = await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stop.cancel()
        if task not in done:  # the client left, or the drain gave up: cancelling aborts the sequences
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if stop in done and stop is not gone:
                raise SHUTTING_DOWN
            return Response(status_code=499)
        return JSONResponse(task.result().to_dict())

    @v1.post("/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @v1.post("/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await generate(request, chat=False)

    @v1.get("/models")
    async def models():
        base = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "mlc-lora",
                "root": server.model_dir, "parent": None}
        data = [base]
        for a in await server.list_adapters():
            data.append({"id": a["name"], "object": "model", "created": server.created, "owned_by": "mlc-lora",
                         "root": str(a.get("path", "")), "parent": server.model_name,
                         **{k: a[k] for k in ("rank", "pinned", "resident", "tier") if k in a}})
        return {"object": "list", "data": data}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        listed = await models()
        for m in listed["data"]:
            if m["id"] == model_id:
                return m
        raise APIError(404, f"The model `{model_id}` does not exist.", "not_found_error", "model_not_found",
                       "model")

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name.strip():
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        if not isinstance(path, str):
            raise APIError(400, "lora_path must be a string", param="lora_path")
        pin, inplace = body.get("pin", False), body.get("load_inplace", False)
        if not isinstance(pin, bool):  # "false" is not False
            raise APIError(400, f"pin must be true or false, got {json.dumps(pin)}", param="pin")
        if not isinstance(inplace, bool):
            raise APIError(400, f"load_inplace must be true or false, got {json.dumps(inplace)}",
                           param="load_inplace")
        real = server.roots.resolve(path)
        await server.load_adapter(name, real, pin=pin, inplace=inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        await server.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @v1.post("/pin_lora_adapter")
    async def pin_lora_adapter(request: Request):
        """Ours (vLLM has none): {"lora_name": ..., "pin": true|false}; pinning an evicted adapter
        pages it back in now."""
        body = await _json_body(request)
        name, pin = body.get("lora_name"), body.get("pin", True)
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        if not isinstance(pin, bool):
            raise APIError(400, "pin must be true or false", param="pin")
        await server.pin_adapter(name, pin)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {'pinned' if pin else 'unpinned'}.")

    app.include_router(v1)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request models the /v1 bodies refer to (the routes read their
        bodies themselves, to answer malformed JSON with OpenAI-style errors)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi  # pylint: disable=import-outside-toplevel

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(s.pop("$defs", {}))
                schemas[model.__name__] = s
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health")
    async def health():
        if not server.engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if server.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        await server.stats()
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
