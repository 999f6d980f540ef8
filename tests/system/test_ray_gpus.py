"""`baton serve`'s GPU placement of Ray actors (deploy/ray_gpus.py) on a real local Ray instance with logical
GPUs (Ray schedules them; nothing here touches a device): round-robin over the GPUs, the actors that share a
GPU bundle see one GPU id and get the KV plan's environment, and through it agree on one KV budget
(baton/engine/gpu_plan.py), whichever writes first; an actor alone on its GPU gets no plan."""

from __future__ import annotations

import pytest
from helpers import local_ray

from deploy.ray_gpus import GpuShare


def test_round_robin_over_the_gpus():
    one = GpuShare.plan(["prefill-0", "decode-0"], 1)
    assert one.bundle_of == {"prefill-0": 0, "decode-0": 0} and one.sharing == [2]
    three = GpuShare.plan(["p0", "d0", "d1"], 2)  # was 2/3 GPU each: Ray could place only two of them
    assert three.bundle_of == {"p0": 0, "d0": 1, "d1": 0} and three.sharing == [2, 1]
    assert GpuShare.plan(["p0", "d0"], 4).sharing == [1, 1]
    # deploy/launch.py --gpus-per-worker F < 1: floor(1 / F) a GPU
    assert GpuShare.for_fraction(["p0", "d0", "d1"], 0.5).sharing == [2, 1]
    assert GpuShare.for_fraction(["p0", "p1", "d0", "d1"], 0.34).sharing == [2, 2]
    assert GpuShare.for_fraction(["p0", "d0"], 0.25).sharing == [2]


def test_launch_passes_the_kv_options_and_plans_fractional_gpus():
    import argparse

    from deploy.launch import add_arguments, specs_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--gpus-per-worker", "0.5", "--slots", "16", "--kv-pages", "64", "--gpu-memory-fraction", "0.8"])
    for s in specs_from_args(a):
        assert (s.options()["slots"], s.options()["kv_pages"], s.options()["gpu_memory_fraction"]) == (16, 64, 0.8)
        assert s.device == "cuda"


@pytest.mark.slow
@pytest.mark.usefixtures("one_ray_at_a_time")
def test_actors_sharing_a_gpu_agree_on_their_kv_budget(tmp_path):
    ray = pytest.importorskip("ray")
    local_ray(
        ray,
        num_cpus=4,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:

        @ray.remote
        class Probe:
            def placed(self, fixed: int):
                import os

                from baton.engine.gpu_plan import agreed_budget
                from baton.settings import Settings

                st = Settings.from_env()
                budget = None
                if st.gpu_workers > 1:
                    budget = agreed_budget(st.gpu_plan, st.gpu_workers, fixed, 100 * 2**30, 0.9, timeout_s=60)
                return ray.get_gpu_ids(), os.environ.get("BATON_GPU_WORKERS"), st.gpu_plan, budget

        names = ["baton-prefill-0", "baton-decode-0", "baton-decode-1"]
        share = GpuShare.plan(names, 2)
        share.create(ray, str(tmp_path / "plan"))
        fixed = {"baton-prefill-0": 20 * 2**30, "baton-decode-0": 30 * 2**30, "baton-decode-1": 36 * 2**30}
        probes = {}
        for n in names:
            opts, env = share.actor_options(n)
            probes[n] = Probe.options(name=n, runtime_env={"env_vars": env}, **opts).remote()
        got = dict(zip(names, ray.get([probes[n].placed.remote(fixed[n]) for n in names], timeout=120)))
        (g0, w0, plan0, b0), (g1, w1, plan1, b1), (g2, w2, plan2, b2) = (got[n] for n in names)
        assert g0 == g2 and len(g0) == 1 and g1 != g0  # prefill-0 and decode-1 share one GPU, decode-0 has its own
        assert (w0, w2, w1, plan1, b1) == ("2", "2", None, None, None)
        assert plan0 == str(tmp_path / "plan" / "gpu0" / "baton-prefill-0")
        want = (int(100 * 2**30 * 0.9) - fixed["baton-prefill-0"] - fixed["baton-decode-1"]) // 2
        assert b0 == b2 == want
        share.remove(ray)
        assert share.group is None
        # a named, detached group (deploy/launch.py): a second launch reuses it; --stop removes it by name
        from deploy.ray_gpus import remove_named

        named = GpuShare.plan(names, 2)
        named.create(ray, str(tmp_path / "plan2"), name="t-gpu-bundles", detached=True)
        again = GpuShare.plan(names, 2)
        again.create(ray, str(tmp_path / "plan3"), name="t-gpu-bundles", detached=True)
        assert again.group.id == named.group.id
        assert remove_named("t-gpu-bundles") is True and remove_named("t-gpu-bundles") is False
    finally:
        ray.shutdown()
