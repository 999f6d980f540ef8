"""Shared pytest fixtures. Markers (gpu, slow), the default timeout and the two test processes (xdist's
-n 2) live in pyproject.toml."""

import itertools
import os
import random
import socket

import pytest


def pytest_configure(config):
    """Under xdist each test process gets its share of the cores for torch's threads (and so do the
    processes its tests start, unless a test sets its own): two processes of all cores each only contend."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


@pytest.fixture
def one_ray_at_a_time():
    """The Ray tests start local Ray clusters (~1-2 GiB and many processes each): one at a time across the
    test processes (an exclusive lock on a file in the temp dir; released when the test ends)."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "baton-tests-ray.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# Ports handed out by pick_free_port: below the kernel's ephemeral range (32768-60999 on Linux), where no
# outgoing connection's local port lands, and a block of its own per xdist process. A port picked by binding
# port 0 came from the ephemeral range, and a gRPC channel of another test could take it before the worker
# bound it (CI at a1963fd: a decode worker exited "address already in use").
_PORT_BLOCK = 1500
_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_PORT_BASE = 20000 + _PORT_BLOCK * (int(_worker[2:]) if _worker[2:].isdigit() else 0) % 12000
_next_port = itertools.count(random.Random(os.getpid()).randrange(_PORT_BLOCK))


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, outside the ephemeral range and in this test process's own block
    (above). Prefer binding port 0 where the API allows it (baton.rpc.build_server(port=0) does); use this
    only for things that need a number up front."""
    for _ in range(_PORT_BLOCK):
        port = _PORT_BASE + next(_next_port) % _PORT_BLOCK
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use, or a closed server's port still in TIME_WAIT
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the block is exhausted: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module: tiny ops on a shared 2-core box, threads only contend.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class FakePool:
    """Fake prefill / decode workers (tests/fakes.py) on loopback plus a router Registry over them,
    probed up once and without its background poller: for unit tests of router.calls / session / exact.

        pool.add("decode", servicer=None, **kw) -> (FakeWorker, registry Worker)
        pool.calls(timeout=5.0, call_timeout=2.0) -> a router.calls.Calls with that deadline from now
    Every server, Calls and the registry are closed at teardown."""

    def __init__(self):
        from baton.settings import Settings
        from router.registry import Registry

        self.settings = Settings(token=None)
        self.registry = Registry(self.settings, check_timeout=0.5)
        self.fakes: list = []
        self._calls: list = []

    def add(self, role: str, servicer=None, **kw):
        import fakes

        if servicer is None:
            servicer = (fakes.FakePrefill if role == "prefill" else fakes.FakeDecode)(self.settings, **kw)
        fake = fakes.FakeWorker(servicer, self.settings)
        self.fakes.append(fake)
        w = self.registry.add(role, fake.address)
        assert self.registry.probe(w), f"fake {role} worker {fake.address} is not up"
        return fake, w

    def calls(self, timeout: float = 5.0, call_timeout: float = 2.0):
        import time

        from router.calls import Calls

        c = Calls(self.registry, deadline=time.monotonic() + timeout, call_timeout=call_timeout)
        self._calls.append(c)
        return c

    def close(self) -> None:
        for c in self._calls:
            c.close()
        self.registry.stop()
        for f in self.fakes:
            f.stop()


@pytest.fixture
def fake_pool():
    """A FakePool (see its docstring); closed after the test."""
    pool = FakePool()
    yield pool
    pool.close()


def pytest_collection_modifyitems(session, config, items):
    """Under xdist, the files with long tests (a `slow` mark, or a run of tests/prestart.py) go first, each
    file's tests in their order: --dist loadfile hands out files in collection order, and a long file left
    for the end ran alone on one core while the other process idled (~2 of the suite's 13 minutes)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    heavy = {
        item.path
        for item in items
        if item.get_closest_marker("slow") is not None or getattr(getattr(item, "module", None), "PRESTART", None)
    }
    items.sort(key=lambda item: item.path not in heavy)  # stable: the same order in every process


def pytest_collection_finish(session):
    """Starts in the background the long subprocess runs (tests/prestart.py) of the collected tests."""
    import prestart

    for item in session.items:
        jobs = getattr(getattr(item, "module", None), "PRESTART", None)
        for name, make in (jobs or {}).items():
            if name == getattr(item, "originalname", None) or name in getattr(item, "fixturenames", ()):
                prestart.start(make())


def pytest_sessionfinish(session):
    import prestart

    prestart.stop_all()
