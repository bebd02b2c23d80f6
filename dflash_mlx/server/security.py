"""Safe by default: what a request must be before any API sees it.

One pure-ASGI middleware (streaming and disconnects pass through untouched) checks, in
order: the `Host` (a server bound to loopback answers loopback names only: no DNS
rebinding), the `Origin` (browsers' pages get nothing unless `--cors-origin` allows them;
loopback origins are allowed), the API key (`Authorization: Bearer` or `x-api-key`,
compared in constant time on the raw bytes, so a UTF-8 key works), the content type (POST
bodies must be `application/json`: a web page cannot send that without a CORS preflight),
and the body (at most `max_body_bytes`, read before anything parses it, the whole of it
within `body_timeout` seconds of the headers). `H11Protocol` drops connections whose
request headers do not all arrive within the keep-alive timeout of their first byte.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11

from .core import APIError

LOOPBACK_ORIGIN = r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$"


# A Host header: `[IPv6]` or a name / IPv4 address, then an optional `:port`; nothing else
# (`[::1]evil.com` is no loopback name). A bare IPv6 address (`::1`) is read as one.
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[^\[\]:]+))(?::\d{1,5})?")


_NUMERIC_V4 = re.compile(r"(?:0x[0-9a-f]+|[0-9]+)(?:\.(?:0x[0-9a-f]+|[0-9]+)){0,3}")


def is_loopback_host(host: str) -> bool:
    """Whether a Host header or `--host` value names loopback: localhost, any spelling of a
    127/8 or ::1 address."""
    host = host.strip().lower()
    parsed = _HOST.fullmatch(host)
    if parsed is not None:
        host = parsed.group("v6") or parsed.group("name")
    elif host.startswith("[") or host.count(":") < 2:
        return False  # neither a host[:port] nor a bare IPv6 address
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    # IPv4 as inet_aton reads it, which is how `--host` binds and browsers read URLs:
    # 127.1, 0x7f.1, 0177.0.0.1, 2130706433 (numbers and dots only: no name resolves).
    if _NUMERIC_V4.fullmatch(host):
        try:
            return socket.inet_aton(host)[0] == 127
        except OSError:
            return False
    return False


def same_origin_ip(origin: str, host: str) -> bool:
    """Whether `origin` is this server's own, reached at an IP address (the chat page at
    `http://192.168.1.5:8080/` asking its own API). Only an address: a name could be an
    attacker's that resolves here (DNS rebinding), an address is the server's own."""
    scheme, _, rest = origin.partition("://")
    if scheme not in ("http", "https") or rest.lower() != host.strip().lower():
        return False
    name = rest[1 : rest.find("]")] if rest.startswith("[") else rest.rsplit(":", 1)[0]
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_origin(origin: str) -> bool:
    """Whether `--cors-origin` takes `origin` by name: `http(s)://host[:port]`."""
    return origin.startswith(("http://", "https://"))


def _how_to_allow(origin: str) -> str:
    if is_origin(origin):
        return f"start the server with --cors-origin {origin} to let that page use it."
    # "null": a file:// page or a sandboxed frame, which any page can make itself.
    return (
        "a page without an origin of its own (a file:// page, a sandboxed frame) cannot be "
        "allowed by name: serve it from http://localhost (loopback origins are allowed), or "
        "start the server with --cors-origin '*' to let every page use it."
    )


@dataclass
class Policy:
    loopback_only: bool  # bound to loopback: refuse other Host names
    cors_origins: tuple[str, ...]  # besides loopback origins
    api_key: str | None
    max_body_bytes: int
    body_timeout: float

    def origin_allowed(self, origin: str) -> bool:
        return (
            origin in self.cors_origins
            or "*" in self.cors_origins
            or bool(re.match(LOOPBACK_ORIGIN, origin))
        )


def given_key(headers: dict[bytes, bytes]) -> bytes:
    """The API key a request carries (`Authorization: Bearer` or `x-api-key`), or b""."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    given = token.strip() if scheme.lower() == b"bearer" else b""
    return given or headers.get(b"x-api-key", b"").strip()


def key_matches(api_key: str | None, headers: dict[bytes, bytes]) -> bool:
    """Whether a request may see what the key guards: no key is set, or it carries it."""
    if api_key is None:
        return True
    # Compared in constant time: no early exit tells a prober how close it was.
    return hmac.compare_digest(given_key(headers), api_key.encode("utf-8"))


class Guard:
    def __init__(self, app, policy: Policy, render: Callable[[APIError, str], object]):
        self.app = app
        self.policy = policy
        self.render = render  # (error, path) -> an ASGI response in the API's own shape

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            receive = await self._check(scope, receive)
        except APIError as err:
            return await self.render(err, scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _check(self, scope, receive):
        p = self.policy
        headers: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k, v)
        host = headers.get(b"host", b"").decode("latin-1")
        if p.loopback_only and not is_loopback_host(host):
            raise APIError(
                403,
                f"Host {host!r} is not allowed: this server listens on loopback and answers "
                "only loopback names (localhost, 127.0.0.1, [::1]).",
                kind="permission_error",
                code="host_not_allowed",
            )
        origin = headers.get(b"origin", b"").decode("latin-1")
        if origin and not (p.origin_allowed(origin) or same_origin_ip(origin, host)):
            raise APIError(
                403,
                f"Origin {origin!r} is not allowed: {_how_to_allow(origin)}",
                kind="permission_error",
                code="origin_not_allowed",
            )
        if p.api_key and scope["path"].startswith(("/v1", "/metrics")):
            self._check_key(headers)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                shown = ctype.decode("latin-1") or "none"
                raise APIError(
                    415,
                    f"The request body must be JSON sent as 'Content-Type: application/json' "
                    f"(got {shown}); with curl add -H 'Content-Type: application/json'.",
                    code="unsupported_media_type",
                )
            return await self._read_body(headers, receive)
        return receive

    def _check_key(self, headers: dict[bytes, bytes]) -> None:
        given = given_key(headers)
        if key_matches(self.policy.api_key, headers):
            return
        what = "no API key" if not given else "an incorrect API key"
        raise APIError(
            401,
            f"You provided {what}: pass it as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
            "(the server's --api-key).",
            kind="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _read_body(self, headers: dict[bytes, bytes], receive):
        """The whole body, read within the limits, replayed to the app."""
        limit = self.policy.max_body_bytes
        too_large = APIError(
            413,
            f"The request body exceeds the server's limit of {limit / 1e6:g} MB (--max-body-mb).",
            kind="request_too_large",
            code="request_too_large",
        )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        timeout = self.policy.body_timeout
        too_slow = APIError(
            408,
            f"The request body did not arrive within {timeout:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is not read
        )
        # One deadline for the whole body: a client trickling a byte at a time gets no more.
        deadline = asyncio.get_running_loop().time() + timeout
        chunks, size, more = [], 0, True
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise too_slow from None
            if message["type"] == "http.disconnect":
                raise APIError(400, "The client disconnected while sending the body.")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


class H11Protocol(_UvicornH11):
    """uvicorn's h11 protocol, plus a deadline for request headers: a client that opens a
    connection (or starts a request) and never finishes its headers is disconnected after
    the keep-alive timeout, instead of holding the connection open forever."""

    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still no complete request headers
            self._await_headers()
        elif self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def connection_lost(self, exc) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.timeout_keep_alive, self._too_slow)

    def _too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
