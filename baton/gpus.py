"""Which GPU a worker process uses, without initialising CUDA (no torch import needed).

A worker process sees one GPU, through CUDA_VISIBLE_DEVICES, as Ray pins an actor. Two callers:
    deploy.processes.start_processes   spreads `--device cuda` workers over the visible GPUs, one each
                                       round-robin (a disaggregated prefill / decode split on one host:
                                       prefill-0 on the first, decode-0 on the second); `baton serve
                                       --colocate` puts them all on the first instead
    worker mains (`--device cuda:N`)   pin_device: N of the visible GPUs becomes the only one, "cuda";
                                       Triton launches and CUDA graphs then follow the tensors' device in
                                       every thread (a current-device setting is per thread)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping

_PROC_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU the driver sees
_CUDA_N = re.compile(r"cuda:(\d+)")


def visible_gpus(env: Mapping[str, str] | None = None, proc_dir: str | None = None) -> list[str]:
    """The GPUs a child process may use: CUDA_VISIBLE_DEVICES' entries (indexes or UUIDs, up to the
    first empty or negative one, as CUDA reads it), else every GPU the NVIDIA driver lists (proc_dir,
    default _PROC_GPUS, read at call time); [] if none."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        try:
            return [str(i) for i in range(len(os.listdir(proc_dir or _PROC_GPUS)))]
        except OSError:
            return []
    out = []
    for x in (s.strip() for s in cvd.split(",")):
        if not x or x.startswith("-"):
            break
        out.append(x)
    return out


def spread(n_workers: int, gpus: list[str], colocate: bool = False) -> list[str | None]:
    """GPU (a CUDA_VISIBLE_DEVICES value) for each of n GPU workers: round-robin over `gpus`, or with
    `colocate` all on gpus[0]; all None (inherit the environment) with fewer than two GPUs, where there
    is nothing to choose."""
    if len(gpus) < 2:
        return [None] * n_workers
    return [gpus[0 if colocate else i % len(gpus)] for i in range(n_workers)]


def pin_device(device: str, env: MutableMapping[str, str] | None = None) -> str:
    """`cuda:N` -> "cuda", with CUDA_VISIBLE_DEVICES narrowed to the N-th visible GPU (call before CUDA
    is initialised: a worker's main). Any other device is returned unchanged. ValueError if there is no
    N-th GPU. Where CUDA is initialised already (an in-process caller) the device is left as it is."""
    m = _CUDA_N.fullmatch(device)
    torch = sys.modules.get("torch")
    if not m or (torch is not None and torch.cuda.is_initialized()):  # too late to narrow: keep cuda:N
        return device
    env = os.environ if env is None else env
    gpus, n = visible_gpus(env), int(m.group(1))
    if n >= len(gpus):
        raise ValueError(f"--device {device}: {len(gpus)} GPU(s) visible")
    env["CUDA_VISIBLE_DEVICES"] = gpus[n]
    return "cuda"
