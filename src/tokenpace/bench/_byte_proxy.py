"""A TCP relay that copies bytes both ways without parsing them: the control arm of
``tokenpace bench gateway --control byte-proxy``.

It answers one question about the gateway's measured cost: how much of it would *any*
second process between the client and the engine cost on this machine? It adds exactly
what the gateway's position adds (one more process to wake, one more loopback hop each way,
one more socket pair per connection) and none of the gateway's work (no HTTP parsing, no
admission, no dispatch, no relay logic). If it loses about as much as the gateway, the loss
is the hop; if it is close to direct, the gateway has a cost of its own to find.

Each accepted connection gets its own upstream connection; bytes are written to the other
side in the callback that read them (``transport.write`` tries the send at once, so no
buffering delay is added), with flow control (a side whose peer's write buffer fills is
paused) and half-closes passed on (EOF from one side becomes ``write_eof`` on the other; the
connection closes once both directions ended or either side reset). Both sockets have
TCP_NODELAY, as the gateway's have (asyncio and uvloop set it on TCP connections).

Run it in its own process: ``python -m tokenpace.bench._byte_proxy PORT UPSTREAM_HOST
UPSTREAM_PORT`` (uvloop when installed, like the gateway).
"""

from __future__ import annotations

import asyncio
import socket
import sys


class _Side(asyncio.Protocol):
    """One socket of a relayed connection; ``peer`` is the other one's protocol."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.eof = False  # EOF was read from this side: its direction ended
        self.closed = False
        self.pending: list[bytes] = []  # read before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def attach(self, peer: _Side) -> None:
        """Relay to ``peer`` from now on; pass on what was read (and an EOF) before."""
        self.peer = peer
        assert peer.transport is not None
        for data in self.pending:
            peer.transport.write(data)
        self.pending.clear()
        if self.eof and peer.transport.can_write_eof():
            peer.transport.write_eof()

    def data_received(self, data: bytes) -> None:
        # Per read: one write to the peer (one send syscall when its buffer is empty).
        peer = self.peer
        if peer is None:
            self.pending.append(data)
        elif not peer.closed:
            peer.transport.write(data)  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            if peer.transport.can_write_eof():
                peer.transport.write_eof()
            if peer.eof:  # both directions ended
                peer.transport.close()
                return False
        return True  # keep this side open for the other direction

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        peer = self.peer
        if peer is None or peer.transport is None or peer.closed:
            return
        if exc is not None:
            peer.transport.abort()  # a reset passes on as a reset
            return
        if peer.transport.can_write_eof() and not self.eof:
            peer.transport.write_eof()
        peer.transport.close()  # after what is buffered for the peer went out

    # flow control: the peer cannot keep up, stop reading from this side
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Side):
    """The accepted side: opens its upstream connection, then relays."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream
        self._connecting: asyncio.Task[None] | None = None  # referenced: the loop's is weak

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.transport is not None
        try:
            _, upstream = await loop.create_connection(_Side, *self.upstream)
        except OSError:
            self.transport.abort()  # nothing to relay to: the client sees the connection go
            return
        if self.closed:
            upstream.transport.close()  # type: ignore[union-attr]
            return
        self.attach(upstream)
        upstream.attach(self)
        if upstream.closed:  # the upstream hung up before we got here
            self.transport.close()


async def start(port: int, upstream_host: str, upstream_port: int,
                host: str = "127.0.0.1") -> asyncio.Server:
    """Listen on ``host:port`` (0: any free port) and relay every connection to the upstream."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Client((upstream_host, upstream_port)), host, port)


async def _serve(port: int, upstream_host: str, upstream_port: int) -> None:
    server = await start(port, upstream_host, upstream_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    port, host, upstream_port = int(argv[0]), argv[1], int(argv[2])
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(port, host, upstream_port))
    else:
        uvloop.run(_serve(port, host, upstream_port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
