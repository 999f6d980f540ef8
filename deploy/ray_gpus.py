"""Where `baton serve` puts Ray worker actors on GPUs, and how the actors that share one size their KV.

Ray places an actor asking for a fraction of a GPU on any GPU with that much left, so the launcher cannot
tell which actors will share one, and two workers on one GPU must agree on their KV budgets
(baton/engine/gpu_plan.py) or the one that sizes second is left a sliver of the memory. So the launcher
places them itself, as `--processes` does (deploy/processes.py start_processes):

    plan = GpuShare.plan(names, gpus)   # worker i on GPU bundle i % min(n, gpus), round-robin in spec order:
                                        # prefill-0 on the first, decode-0 on the next (one GPU: all on it)
    plan.create(ray, plan_root)         # one placement group of one {"GPU": 1, "CPU": k} bundle per GPU used
    cls.options(**plan.actor_options(name))   # that bundle, num_gpus = 1 / (actors in the bundle);
                                              # env: BATON_GPU_WORKERS / BATON_GPU_PLAN where k > 1
    plan.remove(ray)                    # at shutdown (ray.shutdown of a private instance removes it too)
deploy/launch.py --gpus-per-worker F < 1 uses the same plan (GpuShare.for_fraction: floor(1 / F) a GPU), in a
named detached group that `--stop` removes (remove_named).

Every actor of a bundle sees the bundle's one GPU (Ray's fractional GPUs of one bundle are one device).
The plan folder is one per bundle under `plan_root`, a directory on this machine: `baton serve` runs a private
Ray instance or joins one whose actors may land on other nodes, where the worker creates the folder itself
(gpu_plan.agreed_budget makes it); its files are a few bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class GpuShare:
    bundle_of: dict[str, int]  # actor name -> bundle (GPU) index
    sharing: list[int]  # actors per bundle
    plan_root: str | None = None
    group: object = field(default=None, repr=False)  # the Ray placement group, once created

    @classmethod
    def for_fraction(cls, names: list[str], fraction: float) -> GpuShare:
        """deploy/launch.py --gpus-per-worker F < 1: floor(1 / F) workers a GPU, as few GPUs as that needs."""
        k = max(1, int(1.0 / fraction + 1e-9))
        return cls.plan(names, -(-len(names) // k))

    @classmethod
    def plan(cls, names: list[str], gpus: int) -> GpuShare:
        """Round-robin over min(len(names), gpus) bundles (at least one)."""
        used = max(1, min(len(names), int(gpus)))
        bundle_of = {n: i % used for i, n in enumerate(names)}
        return cls(bundle_of, [sum(b == k for b in bundle_of.values()) for k in range(used)])

    def create(self, ray, plan_root: str, timeout: float = 60.0, name: str = "", detached: bool = False) -> None:
        """The placement group (one bundle per GPU used), ready; plan_root holds the plan folders. name /
        detached: a group that outlives this driver (deploy/launch.py), removed by name (remove_named)."""
        from ray.util.placement_group import get_placement_group, placement_group

        self.plan_root = plan_root
        bundles = [{"GPU": 1.0, "CPU": float(k)} for k in self.sharing]
        if name:  # a live launch's group (its actors are reused too: --stop first to change the layout)
            try:
                self.group = get_placement_group(name)
                return
            except ValueError:
                pass
        self.group = placement_group(bundles, strategy="PACK", name=name, lifetime="detached" if detached else None)
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(f"Ray could not reserve {len(bundles)} GPU bundle(s) {bundles} in {timeout:.0f} s")

    def actor_options(self, name: str) -> tuple[dict, dict[str, str]]:
        """(Ray .options() for the actor: its bundle and GPU fraction, the environment it needs: the KV plan
        when it shares its GPU)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = self.bundle_of[name]
        k = self.sharing[b]
        opts = {
            "num_gpus": 1.0 / k,
            "num_cpus": 1.0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=b
            ),
        }
        env = {}
        if k > 1:
            env = {"BATON_GPU_WORKERS": str(k), "BATON_GPU_PLAN": os.path.join(self.plan_root, f"gpu{b}", name)}
        return opts, env

    def describe(self) -> str:
        """The progress line: which worker is in which GPU bundle."""
        return "GPU bundles: " + ", ".join(f"{n.removeprefix('baton-')} on {b}" for n, b in self.bundle_of.items())

    def remove(self, ray) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def remove_named(name: str) -> bool:
    """Removes the placement group `name` (deploy/launch.py --stop); False when there is none."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        group = get_placement_group(name)
    except ValueError:
        return False
    remove_placement_group(group)
    return True
