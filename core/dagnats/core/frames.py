"""Length-prefixed protobuf frames over a stream transport: the local socket
on both of its ends, and the local transport's error.

A frame is a 4-byte big-endian length and that many bytes, a message. An
empty frame after the first is a ping: the client sends one on a connection
whose call has waited with nothing arriving, and the server answers it at
once with an empty frame, whatever call it is serving (no call nor answer is
ever empty; the first frame, a hello, may be).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import grpc

HEADER = struct.Struct(">I")
# As gRPC's default limit on a received message.
MAX_FRAME = 4 * 1024 * 1024
# An empty frame: a ping, or its answer.
PING = HEADER.pack(0)


class TransportError(Exception):
    """A call on the local transport that failed on the way, not in the
    service: the socket could not be reached, the connection ended, no answer
    came in time, the server refused the hello or the call's method. ``code``
    is the status gRPC would have ended the call with (UNAVAILABLE,
    DEADLINE_EXCEEDED, UNAUTHENTICATED, ...); the SDK's retry rules read it
    as they read a gRPC status (``dagnats.sdk._errors``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Frames(asyncio.Protocol):
    """Length-prefixed frames over a stream transport; ``on_frame`` gets each
    one whole. A length over ``MAX_FRAME`` calls ``on_oversize`` and stops
    reading."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._stopped = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        buffer = self._buffer
        buffer += data
        while len(buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer)
            if length > MAX_FRAME:
                buffer.clear()
                self._stopped = True
                self.on_oversize(length)
                return
            end = HEADER.size + length
            if len(buffer) < end:
                return
            frame = bytes(buffer[HEADER.size : end])
            del buffer[:end]
            self.on_frame(frame)

    def send(self, message: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            data = message.SerializeToString()
            self.transport.write(HEADER.pack(len(data)) + data)

    def send_ping(self) -> None:
        """Send an empty frame: a ping, or the answer to one."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(PING)

    def on_frame(self, frame: bytes) -> None:
        raise NotImplementedError

    def on_oversize(self, length: int) -> None:
        raise NotImplementedError
