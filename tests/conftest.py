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
