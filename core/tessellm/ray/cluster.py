"""Importing Ray and joining (or starting) the cluster the replicas run on.

Ray is an optional extra (`pip install 'tessellm[ray]'`): a missing package is a ConfigError
at start-up, before any engine starts. Without an address a local cluster is started with
exactly the CPUs the replicas ask for (`num_cpus`); with one, the running cluster is joined.
`ray.init` is called only when Ray is not initialized yet, and `owned` says whether this
process started it (then it shuts it down).
"""
from __future__ import annotations

import logging
from types import ModuleType

from tessellm.errors import ConfigError

RAY_EXTRA_HINT = "install it with: pip install 'tessellm[ray]'"


REPLICAS = "--data-parallel-size > 1 runs its replicas on Ray"


def import_ray(needed_by: str = REPLICAS) -> ModuleType:
    """The ray module; ConfigError saying what needs it and naming the extra when it is not
    installed."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"{needed_by}, which is not installed ({e}); "
                          f"{RAY_EXTRA_HINT}") from None
    return ray


def join_cluster(address: str | None, num_cpus: int, needed_by: str = REPLICAS) -> bool:
    """Connect to the cluster at `address`, or start a local one of `num_cpus` CPUs. Returns
    whether this call started Ray (the caller then owns it: `ray.shutdown()` at the end)."""
    ray = import_ray(needed_by)
    if ray.is_initialized():
        return False
    options = dict(include_dashboard=False, logging_level=logging.WARNING)
    try:
        if address is None:
            ray.init(num_cpus=num_cpus, **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "a local Ray cluster" if address is None else f"the Ray cluster at {address!r}"
        raise ConfigError(f"cannot start or join {where}: {e}") from None
    return True


def reachable_host(local: bool) -> str:
    """The address the front end binds its sockets to, for actors to connect back: loopback
    on a local cluster, else this node's address in the cluster."""
    if local:
        return "127.0.0.1"
    return import_ray().util.get_node_ip_address()
