"""baton.client.Client and the `baton generate` / `baton health` commands against a fake cluster."""

import json

import grpc
import pytest
from fakes import Cluster, reference

from baton import cli
from baton.client import Client, Delta
from baton.settings import Settings

TOKEN = "cli-token"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(n_prefill=1, n_decode=1, token=TOKEN)
    yield c
    c.close()


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


def test_client_generate_model_info_health(cluster):
    with Client(cluster.address, token=TOKEN) as c:
        deltas = list(c.generate([4, 5], max_new_tokens=7, mode="exact", engine="mtp", draft_block=3))
        assert all(isinstance(d, Delta) for d in deltas)
        assert [t for d in deltas for t in d.token_ids] == reference([4, 5], 7)
        assert deltas[-1].finish_reason == "LENGTH" and deltas[-1].usage["completion_tokens"] == 7
        assert deltas[-1].stats["drafted"] > 0
        ids = list(c.generate(token_ids=[4, 5], max_new_tokens=3))
        assert [t for d in ids for t in d.token_ids] == reference([4, 5], 3)
        assert c.model_info().vocab_size == 100
        assert c.health() == "SERVING" and c.health("baton.v1.Router") == "SERVING"
        with pytest.raises(ValueError):
            c.generate([1], mode="slow")
    assert cluster.wait_sessions_zero()


def test_client_health_of_nothing():
    from conftest import pick_free_port

    with Client(f"127.0.0.1:{pick_free_port()}", settings=Settings()) as c:
        assert c.health(timeout=1) == "UNAVAILABLE"


def test_cli_generate_json(cluster, token_file, capsys):
    rc = cli.main(
        [
            "generate",
            "--addr",
            cluster.address,
            "--token-file",
            token_file,
            "--prompt-ids",
            "4,5",
            "--max-new-tokens",
            "6",
            "--mode",
            "exact",
            "--engine",
            "fp8",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["token_ids"] == reference([4, 5], 6) and out["finish_reason"] == "LENGTH"
    assert (
        out["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "cached_tokens": 0} and "ttft_ms" in out["stats"]
    )


def test_cli_generate_errors(cluster, token_file, capsys):
    rc = cli.main(["generate", "--addr", cluster.address, "--token-file", token_file, "--prompt-ids", "4,500"])
    assert rc == 1 and "INVALID_ARGUMENT: token_ids:" in capsys.readouterr().err
    rc = cli.main(["generate", "--addr", cluster.address, "--prompt-ids", "4,5"])  # no token
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    rc = cli.main(["generate", "--addr", cluster.address, "--token-file", token_file])
    assert rc == 2


def test_cli_health(cluster, capsys):
    from conftest import pick_free_port

    assert cli.main(["health", "--addr", cluster.address]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert cli.main(["health", "--addr", f"127.0.0.1:{pick_free_port()}", "--timeout", "1"]) == 3  # unreachable
    assert capsys.readouterr().out.strip() == "UNAVAILABLE"


def test_client_stops_early_cancels(cluster):
    cluster.decode[0].servicer.delay = 0.05
    try:
        with Client(cluster.address, token=TOKEN) as c:
            it = c.generate([4, 5], max_new_tokens=100)
            next(it)
            it.close()
        assert cluster.wait_sessions_zero(2.0)
    finally:
        cluster.decode[0].servicer.delay = 0.0
    with pytest.raises(grpc.RpcError):
        with Client(cluster.address, settings=Settings()) as c:
            list(c.generate([4, 5], max_new_tokens=2))
