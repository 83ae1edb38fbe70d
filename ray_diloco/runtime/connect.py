"""Layer: runtime (Ray shell). Connecting to an existing Ray cluster, for `train --address` and
`ray-diloco scale`: a cluster that is not there, or that refuses this process's token, is bad
input (one `error:` line naming the address and the fix), not a traceback of Ray's GCS client.
"""

from __future__ import annotations

import socket
from typing import Any

import ray

from ray_diloco.config import ConfigError

# What Ray 2.60's GCS client says, somewhere in the chain under its ConnectionError, when the
# cluster has token authentication on and this process has no (or another) token.
AUTH_REFUSED = "InvalidAuthToken"
# Ray 2.60's `ray.init` retries a GCS address where nothing listens for ever (measured: still
# retrying after 11 minutes), so a mistyped host:port is tried here first.
REACH_TIMEOUT_S = 10.0


def connect(address: str, namespace: str, **init_args: Any) -> Any:
    """`ray.init` of the cluster at `address`; ConfigError if it cannot be reached."""
    _reachable(address)
    try:
        return ray.init(address=address, namespace=namespace, **init_args)
    except ConnectionError as err:
        raise ConfigError(_why(address, err)) from None


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """The host and port of a GCS address ("10.0.0.2:6379", "[::1]:6379"); None for what is
    left to Ray ("auto", "local", ray:// client addresses)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def _reachable(address: str) -> None:
    """A GCS address must accept a TCP connection."""
    gcs = gcs_host_port(address)
    if gcs is None:
        return
    try:
        socket.create_connection(gcs, timeout=REACH_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(_no_cluster(address, err.strerror or str(err))) from None


def _why(address: str, err: BaseException) -> str:
    chain: list[str] = []
    e: BaseException | None = err
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    if any(AUTH_REFUSED in text for text in chain):
        return (
            f"Ray at {address} refused this process's token: the cluster has token "
            "authentication on; set RAY_AUTH_MODE=token and the cluster's token "
            "(~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)"
        )
    return _no_cluster(address, str(err).splitlines()[0])


def _no_cluster(address: str, why: str) -> str:
    return (
        f"no Ray cluster at {address} ({why}); start one (ray start --head) or give its "
        "address (host:port of the head's GCS) with --address or RAY_ADDRESS"
    )
