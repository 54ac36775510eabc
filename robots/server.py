"""Policy server and client: websocket, msgpack-encoded messages with numpy arrays.

Protocol (every message a msgpack map with ``type``):
  client -> server  {"type": "hello", "contract": {...}}      first message of a connection
  server -> client  {"type": "hello", "contract": {...}}      or {"type": "error"} and the close
  client -> server  {"type": "infer", "id": n, "obs": {"state": f32 [S],
                     "images": {name: u8 [H, W, 3]}, "instruction": str}}
  server -> client  {"type": "chunk", "id": n, "actions": f32 [K, A],
                     "timing": {"queue_ms", "infer_ms"}}
                    or {"type": "error", "id": n, "error": "..."}
``GET /health`` answers 200 with the contract's summary. The contract (action spec, state names,
cameras, normalization version) must match exactly, or the handshake is refused. One inference
thread serves every client in arrival order through a bounded queue; when it is full a request
gets {"type": "error", "error": "busy"} at once instead of waiting (no unbounded backlog under a
flood). A malformed or oversized message gets an error reply; the server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable

import msgpack
import numpy as np

from embodied.schema import UserError

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = (
    8 * 2**20
)  # a few camera frames; larger requests are refused with an error reply


def _encode(obj):
    if isinstance(obj, np.ndarray):
        return {
            "__nd__": True,
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
            "data": obj.tobytes(),
        }
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _decode(obj):
    if obj.get("__nd__"):
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    return obj


def pack(message: dict) -> bytes:
    return msgpack.packb(message, default=_encode, use_bin_type=True)


def unpack(data: bytes) -> dict:
    message = msgpack.unpackb(data, object_hook=_decode, raw=False)
    if not isinstance(message, dict) or "type" not in message:
        raise ValueError("a message is a map with a 'type'")
    return message


class PolicyServer:
    """Serve ``infer(obs dict) -> float [K, A]`` under ``contract`` on ``host:port`` (port 0: any
    free port; ``self.port`` tells which). ``start()`` runs it on a background thread."""

    def __init__(
        self,
        infer: Callable[[dict], np.ndarray],
        contract: dict,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        queue_size: int = 8,
        max_bytes: int = MAX_MESSAGE_BYTES,
    ):
        self.infer = infer
        self.contract = contract
        self.host = host
        self.port = port
        self.queue_size = queue_size
        self.max_bytes = max_bytes
        self.stats = {"requests": 0, "errors": 0, "busy": 0, "clients": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop = None
        self._thread: threading.Thread | None = None
        self._bind_error: OSError | None = None  # why it could not listen, for start() to raise

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> PolicyServer:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"the policy server did not start on {self.host}:{self.port}")
        if self._bind_error is not None:
            reason = self._bind_error.strerror or self._bind_error
            raise UserError(f"cannot serve on {self.host}:{self.port}: {reason}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except OSError as e:  # the port is taken, or the host is not this machine's
            if self._ready.is_set():
                raise
            self._bind_error = e
            self._ready.set()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def serve_forever(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from websockets.asyncio.server import serve

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=self.queue_size)
        worker = asyncio.create_task(self._infer_worker())
        async with serve(
            self._client,
            self.host,
            self.port,
            max_size=2 * self.max_bytes,
            process_request=self._health,
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            log.info("policy server on ws://%s:%d", self.host, self.port)
            self._ready.set()
            await self._stop.wait()
        worker.cancel()

    # --- http health ---------------------------------------------------------------------------
    def _health(self, connection, request):
        if request.path == "/health":  # a JSON document (sent as text/plain)
            return connection.respond(
                200, json.dumps({"ok": True, "contract": self.contract, **self.stats})
            )
        return None

    # --- inference: one thread, arrival order ---------------------------------------------------
    async def _infer_worker(self) -> None:
        while True:
            obs, future, queued_at = await self._queue.get()
            t0 = time.monotonic()
            try:
                actions = await asyncio.to_thread(self.infer, obs)
                future.set_result(
                    (
                        np.asarray(actions, dtype=np.float32),
                        (t0 - queued_at) * 1e3,
                        (time.monotonic() - t0) * 1e3,
                    )
                )
            except Exception as e:  # the model failed on this input: that client hears why
                future.set_exception(e)

    # --- one client -----------------------------------------------------------------------------
    async def _client(self, ws) -> None:
        self.stats["clients"] += 1
        try:
            if not await self._handshake(ws):
                return
            async for data in ws:
                reply = await self._answer(data)
                await ws.send(pack(reply))
        except Exception as e:  # a client that vanished mid-request: only its connection ends
            log.info("client connection ended: %s", e)
        finally:
            self.stats["clients"] -= 1

    async def _handshake(self, ws) -> bool:
        try:
            hello = unpack(await ws.recv())
        except Exception as e:
            await ws.send(pack({"type": "error", "error": f"bad hello: {e}"}))
            return False
        theirs = hello.get("contract") if hello.get("type") == "hello" else None
        if theirs != self.contract:
            diff = sorted(
                k
                for k in set(self.contract) | set(theirs or {})
                if (theirs or {}).get(k) != self.contract.get(k)
            )
            await ws.send(
                pack(
                    {
                        "type": "error",
                        "error": f"contract mismatch in {diff}; the server serves {self.contract}",
                    }
                )
            )
            await ws.close(1008, "contract mismatch")
            return False
        await ws.send(pack({"type": "hello", "contract": self.contract}))
        return True

    async def _answer(self, data) -> dict:
        self.stats["requests"] += 1
        if not isinstance(data, bytes) or len(data) > self.max_bytes:
            self.stats["errors"] += 1
            size = len(data) if data is not None else 0
            return {
                "type": "error",
                "error": f"request of {size} bytes refused "
                f"(binary msgpack up to {self.max_bytes} bytes)",
            }
        try:
            message = unpack(data)
            if message["type"] != "infer" or not isinstance(message.get("obs"), dict):
                raise ValueError(
                    f"expected an 'infer' message with 'obs', got type {message.get('type')!r}"
                )
        except Exception as e:
            self.stats["errors"] += 1
            return {"type": "error", "error": f"malformed request: {e}"}
        future = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((message["obs"], future, time.monotonic()))
        except asyncio.QueueFull:
            self.stats["busy"] += 1
            return {"type": "error", "id": message.get("id"), "error": "busy"}
        try:
            actions, queue_ms, infer_ms = await future
        except Exception as e:
            self.stats["errors"] += 1
            return {"type": "error", "id": message.get("id"), "error": f"inference failed: {e}"}
        return {
            "type": "chunk",
            "id": message.get("id"),
            "actions": actions,
            "timing": {"queue_ms": queue_ms, "infer_ms": infer_ms},
        }


class PolicyClient:
    """Blocking client: ``infer(obs dict) -> float32 [K, A]``; raises on an error reply, a timeout
    or a lost connection (the control loop's watchdog then holds the arm)."""

    def __init__(self, url: str, contract: dict, *, timeout_s: float = 2.0):
        from websockets.exceptions import InvalidHandshake, InvalidURI
        from websockets.sync.client import connect

        self.timeout_s = timeout_s
        try:
            self.ws = connect(url, max_size=2 * MAX_MESSAGE_BYTES, open_timeout=timeout_s)
        except InvalidURI as e:
            raise UserError(f"policy server {url!r}: {e}") from None
        except (OSError, InvalidHandshake) as e:  # refused, unreachable, timed out, not a server
            raise ConnectionError(f"policy server {url}: cannot connect ({e})") from None
        self.ws.send(pack({"type": "hello", "contract": contract}))
        try:
            reply = unpack(self.ws.recv(timeout=timeout_s))
        except TimeoutError:
            self.ws.close()
            message = f"policy server {url}: no answer to the handshake within {timeout_s:g} s"
            raise ConnectionError(message) from None
        if reply["type"] != "hello":
            self.ws.close()
            raise ConnectionRefusedError(f"policy server at {url} refused: {reply.get('error')}")
        self._id = 0
        self._lock = threading.Lock()  # one request at a time on the connection
        self.last_timing = {}
        self.round_trip_ms = []

    def infer(self, obs: dict, timeout_s: float | None = None) -> np.ndarray:
        """The chunk for ``obs``, within ``timeout_s`` (None: the client's)."""
        with self._lock:
            self._id += 1
            t0 = time.monotonic()
            self.ws.send(pack({"type": "infer", "id": self._id, "obs": obs}))
            reply = self._reply_to(self._id, t0, timeout_s or self.timeout_s)
        self.round_trip_ms.append((time.monotonic() - t0) * 1e3)
        if reply["type"] != "chunk":
            raise RuntimeError(f"policy server: {reply.get('error')}")
        self.last_timing = reply["timing"]
        return reply["actions"]

    def _reply_to(self, request: int, t0: float, timeout_s: float) -> dict:
        """The reply to ``request`` (sent at ``t0``) within ``timeout_s``. A reply to an earlier
        request, which came after its own timeout, is dropped: its chunk is a step stale. A reply
        without an id (to a message the server could not read) is this request's."""
        while True:
            left = timeout_s - (time.monotonic() - t0)
            reply = unpack(self.ws.recv(timeout=max(left, 0.0)))
            answered = reply.get("id")
            if answered is None or answered == request:
                return reply
            log.warning("policy server: dropped the late reply to request %s", answered)

    def close(self) -> None:
        self.ws.close()
