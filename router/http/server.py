"""uvicorn on a thread of the router process, on a socket bound here (so a busy port is an OSError at
start-up and port 0 gives a free one).

    srv = HttpServer(app, host="127.0.0.1", port=8000, settings=settings)   # bound and serving
    srv.port, srv.url                     # "http://127.0.0.1:8000" ("https://..." with TLS)
    srv.begin_stop()                      # no new connections; requests in flight go on
    srv.stop(grace)                       # waits up to grace s for them, then cancels what is left

TLS comes from the router's own Settings: BATON_TLS_CERT + BATON_TLS_KEY (or --tls-cert / --tls-key)
serve HTTPS; with BATON_TLS_CA clients must present a certificate it signed, as on the gRPC port.
"""

from __future__ import annotations

import socket
import ssl
import threading


class HttpServer:
    def __init__(self, app, *, host: str, port: int, settings, grace: float = 5.0, start_timeout: float = 15.0):
        import uvicorn

        tls = settings.tls_enabled
        config = uvicorn.Config(
            app,
            log_level="warning",
            log_config=None,  # uvicorn's records go through the process's handler (baton/logs.py: plain or JSON)
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=grace,
            ssl_certfile=settings.tls_cert if tls else None,
            ssl_keyfile=settings.tls_key if tls else None,
            ssl_ca_certs=settings.tls_ca if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and settings.tls_ca else ssl.CERT_NONE,
        )
        config.load()  # certificate errors raise here, in the caller
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=2048)
        except OSError as e:
            raise OSError(
                e.errno,
                f"--http-port {port}: cannot listen on {host}:{port}: {e.strerror} "
                f"(pass another --http-port, or 0 for no HTTP API)",
            ) from None
        self.host, self.port = host, self._sock.getsockname()[1]
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True, name="baton-http"
        )
        self._thread.start()
        stop = threading.Event()
        while not self._server.started:
            if not self._thread.is_alive() or stop.wait(0.02) or start_timeout <= 0:
                break
            start_timeout -= 0.02
        if not self._server.started:
            self.stop(0)
            raise OSError(f"http: the server on {host}:{self.port} did not start")

    def begin_stop(self) -> None:
        self._server.should_exit = True

    def stop(self, grace: float = 5.0) -> None:
        self.begin_stop()
        self._thread.join(grace + 2.0)
        if self._thread.is_alive():  # past its graceful timeout: close what is left
            self._server.force_exit = True
            self._thread.join(2.0)
        self._sock.close()
