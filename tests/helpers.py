"""Shared test helpers (import as `from helpers import make_tiny_dir`)."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

_CACHE: dict[tuple, Path] = {}
ROOT = Path(__file__).resolve().parents[1]  # the repository
_CACHE_ROOT: Path | None = None


def _cache_root() -> Path:
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="baton-tiny-cache-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, True)
    return _CACHE_ROOT


def make_tiny_dir(tmp_path: Path, **kw) -> Path:
    """A fresh copy (safe to modify) of `baton.random_checkpoint.make_random_checkpoint(**kw)` under `tmp_path`.

    Each distinct set of arguments is generated once per test process and copied afterwards, so
    many tests can use the same tiny checkpoint cheaply.
    """
    from baton.random_checkpoint import make_random_checkpoint

    key = tuple(sorted(kw.items()))
    if key not in _CACHE:
        _CACHE[key] = make_random_checkpoint(_cache_root() / f"m{len(_CACHE)}", **kw)
    name = re.sub(r"[^A-Za-z0-9=._-]", "_", "-".join(["tiny"] + [f"{k}={v}" for k, v in key]))
    dest = Path(tmp_path) / name
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{name}-{n}")
        n += 1
    shutil.copytree(_CACHE[key], dest)
    return dest


def local_ray(ray, **kw):
    """ray.init of a test's local cluster, in a temp dir of its own.

    On 2 loaded cores Ray's own start-up waits can run out: its raylet must register within a fixed 30 s
    (ray._private.node; a CI run at 1158421 timed out so) and its GCS must write its port file within
    `RAY_gcs_server_port_wait_time_s` (30 s by default; a CI run at 5c4645e timed out so). The GCS wait is
    raised to 120 s unless the environment sets it, and either time-out is retried once, in a new temp dir,
    the half-started cluster stopped first. Any other failure is raised at once.
    """
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in (1, 2):
        try:
            return ray.init(_temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"), **kw)
        except Exception as e:
            startup_timeout = "timed out during startup" in str(e) or "Timed out waiting for file" in str(e)
            if attempt == 2 or not startup_timeout:
                raise
            ray.shutdown()


def self_signed_cert(tmp_path: Path, common_name: str = "localhost") -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1 (a CA of itself): (cert.pem, key.pem) paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def interp_job(name: str):
    """tests/<name> in a subprocess under Triton's interpreter (TRITON_INTERPRET=1, the repo root on
    PYTHONPATH), as a tests/prestart.py Job: a test module's PRESTART starts it in the background."""
    import os
    import sys

    import prestart

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return prestart.Job(f"interp-{name}", [sys.executable, str(ROOT / "tests" / name)], env=env)


def run_interp_script(name: str, timeout: float) -> dict:
    """Runs tests/<name> under Triton's interpreter (interp_job: or waits for its prestarted run) and
    returns the JSON verdict of its last stdout line; fails the test on a non-zero exit."""
    import json

    import prestart

    p = prestart.run(interp_job(name), timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def rows_with_logits(runner, slot: int, ids_w, n: int):
    """ModelRunner's eager rows with logits: ids_w [W] -> (greedy [W], logits [W, vocab])."""
    import torch

    with torch.inference_mode():
        runner.ids_buf.copy_(ids_w)
        runner.select(slot)
        logits = runner.compute_rows(slot, n)
        return runner.tok_out.clone(), logits


def rows_batch_steps(runner, slots, n: int) -> list[list[int]]:
    """Each slot's pending token, then n - 1 AR steps of all slots together in one rows_batch each ->
    per slot its n tokens (what each slot would decode alone, by batch invariance)."""
    got = [[int(runner.state.next_token[s])] for s in slots]
    for _ in range(n - 1):
        toks = runner.rows_batch([(s, [g[-1]]) for s, g in zip(slots, got)])
        for g, t in zip(got, toks):
            g.append(t[0])
    return got


def wait_serving(client, timeout: float = 60.0, poll: float = 0.05) -> str:
    """Polls the router's health until SERVING or `timeout`; -> the last status."""
    import time

    end = time.monotonic() + timeout
    while (status := client.health()) != "SERVING" and time.monotonic() < end:
        time.sleep(poll)
    return status


class CountedGraph:
    """A captured graph stand-in that logs its key at each replay: through `replay()` (torch's call) or
    through the GIL-holding launcher (baton/engine/nogil.py), which takes `raw_cuda_graph_exec()` of it
    once and then launches that exec, so the launcher's `replay` is wrapped too (`count_graph_replays`)."""

    def __init__(self, graph, log: list, key: tuple):
        self.graph, self.log, self.key = graph, log, key

    def replay(self) -> None:
        self.log.append(self.key)
        self.graph.replay()

    def raw_cuda_graph_exec(self):
        return self.graph.raw_cuda_graph_exec()


def count_graph_replays(monkeypatch, runner, kinds) -> list[tuple]:
    """Wrap `runner`'s captured graphs whose key's kind is in `kinds` -> the list each replay appends its key
    to (in order), whichever path launches it. `monkeypatch` undoes the launcher's wrapper after the test."""
    from baton.engine import nogil

    log: list[tuple] = []
    for key, graph in list(runner.graphs.items()):
        if key[0] in kinds:
            runner.graphs[key] = CountedGraph(graph, log, key)
    launcher = nogil.launcher()
    if launcher is not None:
        launch = launcher.replay

        def replay(graph, stream):
            if isinstance(graph, CountedGraph):
                graph.log.append(graph.key)
            launch(graph, stream)

        monkeypatch.setattr(launcher, "replay", replay)
    return log


def exported(engine, sid: str) -> dict:
    """An ExactEngine session's exported state: {tensor name: a copy, "pos": position, "next": next token}."""
    tensors, pos, nxt = engine.export(sid)
    return {**{t.name: t.materialize().clone() for t in tensors}, "pos": pos, "next": nxt}


def decoded_alone(engine, prompts: list, gs: list) -> tuple[list, list]:
    """Each prompt prefilled on `engine` (an ExactEngine) and decoded g AR steps alone, each step checked
    against engine.generate -> (each prompt's reference tokens [g + 2], its state after the g steps:
    exported); every session released."""
    refs, states = [], []
    for prompt, g in zip(prompts, gs):
        ref = engine.generate(prompt, g + 2)
        s, _ = engine.prefill(prompt)
        for want in ref[1 : g + 1]:
            assert engine.step(s.id) == want
        refs.append(ref)
        states.append(exported(engine, s.id))
        engine.release(s.id)
    return refs, states


def re_prefill_together(engine, prompts: list, refs: list, gs: list, timeout: float) -> list:
    """Re-prefills of every prompt + its first g reference tokens (generated=g: a dead decode worker's
    sessions), all at once, each from its own thread; their first replay blocks wait for one another (all
    counted live by then), so they share passes from the first block on. -> each (session, next token)."""
    import threading

    call, started, met = engine.replays.gather.call, set(), threading.Barrier(len(prompts))

    def first_block_together(replay):
        if id(replay) not in started:
            started.add(id(replay))
            met.wait(60)
        return call(replay)

    engine.replays.gather.call = first_block_together
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = engine.prefill(prompts[i] + refs[i][: gs[i]], generated=gs[i])

    th = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout)
    return out


def slot_state(runner, slot: int) -> dict:
    """Every exported tensor of a runner's slot (cloned), its position and next token: what a prefill left."""
    out = {t.name: t.materialize().clone() for t in runner.state.export(slot)}
    out["position"] = int(runner.state.position[slot])
    out["next_token"] = int(runner.state.next_token[slot])
    return out


def assert_same_state(a: dict, b: dict) -> None:
    """Two slot_state()s bitwise equal, named by the first key that differs."""
    import torch

    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def router_without_workers(token: str, http_port: int, **config):
    """serve_router (gRPC on a free port, HTTP on http_port) over the embedded model's metadata, its prefill
    and decode workers an address nothing answers (127.0.0.1:9): never up. -> (handle, servicer); stop it
    with router.__main__.stop_router. config: RouterConfig fields."""
    from baton.settings import Settings
    from router.__main__ import serve_router
    from router.service import RouterConfig

    model_dir = Path(__file__).resolve().parents[1] / "baton" / "assets" / "default-model"
    return serve_router(
        prefill=["127.0.0.1:9"],
        decode=["127.0.0.1:9"],
        model_dir=str(model_dir),
        port=0,
        settings=Settings(token=token),
        config=RouterConfig(**config),
        http_port=http_port,
    )


def inprocess_cluster(
    lm,
    max_len: int,
    *,
    decodes: int = 1,
    prefills: int = 1,
    default_engine: str = "bf16",
    prefix_cache: int | None = None,
    http_port: int = 0,
):
    """A router, `prefills` prefill workers and `decode` decode workers in this process, over loopback gRPC, on
    the loaded model -> (client, decode worker handles, close); close.prefills: the prefill workers' handles
    (a test stops one). prefix_cache: the prefill workers' (serve_prefill's); http_port > 0: the router's HTTP
    API there too."""
    from baton.client import Client
    from baton.settings import Settings
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    st = Settings()
    ps = [serve_prefill(lm, max_len=max_len, settings=st, prefix_cache=prefix_cache)[0] for _ in range(prefills)]
    ds = [serve_decode(lm, max_len=max_len, settings=st, default_engine=default_engine)[0] for _ in range(decodes)]
    rh, rs = serve_router(
        prefill=[p.address for p in ps], decode=[d.address for d in ds], settings=st, http_port=http_port
    )
    c = Client(rh.address)
    wait_serving(c)

    def close():
        c.close()
        stop_router(rh, rs, 0)
        for w in ps + ds:
            w.stop(0)

    close.prefills = ps
    return c, ds, close
