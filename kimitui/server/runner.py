"""Putting the app on a socket: the loopback rule, binding with one-line errors, uvicorn in a thread.

Used by ``kimitui serve`` (foreground), by the TUI's ``--serve`` (background thread, sharing
its engine) and by the tests.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

import uvicorn

from kimitui.errors import UserError


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other name may resolve to a public interface


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose an unauthenticated engine beyond this machine."""
    if not is_loopback(host) and not api_key:
        raise UserError(
            f"refusing to listen on {host} without an API key: pass --api-key KEY "
            "(or set KIMITUI_API_KEY or server.api_key), or use --host 127.0.0.1"
        )


def bind_socket(host: str, port: int, *, v6only: bool = False) -> socket.socket:
    """A listening socket, so a busy port or a bad host is one clear line before uvicorn starts.
    ``v6only``: an IPv6 socket takes IPv6 alone (beside an IPv4 socket on the same port)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:  # an address family this kernel does not have (IPv6 off)
        raise UserError(f"cannot listen on {host}: {exc.strerror}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only and family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    # Listening now lets clients connect (and wait) from the moment the address is printed.
    sock.listen(2048)
    return sock


def bind_all(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per address, all on one port (llama-server's "127.0.0.1,::1"):
    port 0 is chosen by the first bind, then asked of the others. All or none."""
    several = len(hosts) > 1
    sockets = [bind_socket(hosts[0], port, v6only=several)]
    try:
        for host in hosts[1:]:
            sockets.append(bind_socket(host, sockets[0].getsockname()[1], v6only=several))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bound_names(hosts: list[str], sockets: list[socket.socket]) -> str:
    """What the Host check takes as this server's own: the names given and the addresses they
    bound (comma-separated, no empty entry), for ``create_app``'s ``bind_host``."""
    return ",".join(dict.fromkeys([h for h in hosts if h] + [sock.getsockname()[0] for sock in sockets]))


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def uvicorn_server(app, *, quiet: bool) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        # quiet: inside the TUI, where log lines would tear the screen; requests reach on_request.
        log_config=None if quiet else uvicorn.config.LOGGING_CONFIG,
        log_level=logging.CRITICAL if quiet else logging.INFO,
        access_log=not quiet,
        # Open streams end when the server stops; their generations are cancelled by the app.
        timeout_graceful_shutdown=3,
        # Longer than httpx's (so the OpenAI SDK's) 5 s keep-alive: with uvicorn's default, also
        # 5 s, a client may reuse an idle connection just as the server closes it, and its
        # request dies with a ReadError (the likely cause of one in a soak run: bench-soak).
        timeout_keep_alive=30,
        lifespan="off",
    )
    return uvicorn.Server(config)


class ServerThread:
    """uvicorn serving ``app`` on ``sock`` from a daemon thread; ``stop()`` ends it."""

    def __init__(self, app, sock: socket.socket, *, quiet: bool = True) -> None:
        self.sock = sock
        self.url = base_url(sock)
        self.server = uvicorn_server(app, quiet=quiet)
        self._thread = threading.Thread(target=self._serve, name="kimitui-api", daemon=True)
        self._error: BaseException | None = None

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            self._error = exc

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        waited = 0.0
        while not self.server.started:
            if not self._thread.is_alive() or waited >= timeout:
                raise RuntimeError(f"the API server did not start: {self._error or 'timed out'}")
            self._thread.join(0.02)
            waited += 0.02
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
