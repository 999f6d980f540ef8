"""Shared pytest fixtures. Markers (gpu, slow) and the default timeout live in pyproject.toml."""

import socket

import pytest


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago. Prefer binding port 0 where the API allows it
    (baton.rpc.build_server(port=0) does); use this only for things that need a number up front."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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
