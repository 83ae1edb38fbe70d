"""Layer: runtime (Ray shell). The one place that turns a Ray exception into a failure kind.

`classify_ray_error` maps whatever a `ray.get`/`ray.wait` on a learner, host or synchronizer call
raised to the plain strings the control layer's failure policy understands. The first six are
the values of the control layer's failure-kind str-Enum; the last three are *transient* kinds
this shell handles itself (retry, re-place, re-pull) before it ever reports a failure:

==============  ============================================================================
``crash``        the actor's process died (segfault, OOM kill, ``ray.kill``, exception in
                 ``__init__``, restarts exhausted); also the fallback for anything unknown
``preemption``   the actor died because its node was drained as preempted (spot/TPU reclaim)
``hang``         a call did not answer in time (``GetTimeoutError``, ``TimeoutError``)
``node_lost``    the node under the actor died or became unreachable
``partition``    (never returned here: a partition looks like a hang to Ray; the supervisor
                 decides it from heartbeats)
``numerical``    (never returned here: NaN/norm-guard rejections come from the algorithm)
``unavailable``  ``ActorUnavailableError``: the actor is restarting or a connection dropped;
                 the call may or may not have run. Transient: retry after a backoff
``placement``    the actor cannot be placed or lost its place: its placement group was
                 removed (also: an actor killed by that removal), it is unschedulable, or a
                 learner group's placement group did not become ready
``object_lost``  an object (or its owner) is gone: ``ObjectLostError``/``OwnerDiedError``;
                 re-pull the fragment from a live learner
==============  ============================================================================

What Ray 2.60 exposes (read in ``ray/exceptions.py`` and ``ray/_private/serialization.py``):
``ActorDiedError`` keeps only ``error_msg`` (a string) and the ``preempted`` property; the
``ActorDiedErrorContext`` proto it was built from (with ``reason`` NODE_DIED / RAY_KILL /
WORKER_DIED and ``node_death_info``) is *not* kept on the exception. ``preempted`` is True
exactly when ``node_death_info.reason == AUTOSCALER_DRAIN_PREEMPTED``. Node death therefore is
recognised from the GCS message text, "The actor died because its node has died." (a string in
``gcs_server``), which ends up in ``error_msg``.
"""

from __future__ import annotations

import logging

from ray import exceptions as rex

from ray_diloco.control.events import FailureKind

logger = logging.getLogger(__name__)

# The failure kinds this classifier reports to the policy (`FailureKind` is a str-Enum, so
# they compare equal to the plain strings of the table above).
CRASH, PREEMPTION = FailureKind.CRASH, FailureKind.PREEMPTION
HANG, NODE_LOST = FailureKind.HANG, FailureKind.NODE_LOST
UNAVAILABLE = "unavailable"
PLACEMENT = "placement"
OBJECT_LOST = "object_lost"

#: Kinds this shell retries or re-places itself; the others go to the failure policy.
TRANSIENT_KINDS = frozenset({UNAVAILABLE, PLACEMENT, OBJECT_LOST})

# Substrings of the GCS/core-worker messages that mean "the node went away" (Ray 2.60
# gcs_server and _raylet.so strings). Lower-cased for matching.
_NODE_DEATH_MARKERS = (
    "its node has died",
    "node it was running on is dead",
    "node is dead",
)


# Worker exit detail when the actor's placement group is removed (measured in 2.60).
_PG_REMOVED_MARKER = "placement group was removed"


class PlacementTimeoutError(TimeoutError):
    """A learner group's placement group was not ready in time (raised by `resources.py`).

    A subclass of `TimeoutError` so generic callers still see a timeout, but classified as
    ``placement``, not ``hang``: nothing is running yet, the cluster lacks resources.
    """


def classify_ray_error(exc: BaseException) -> str:
    """Map an exception from a Ray call to a failure kind (see the module docstring)."""
    # A RayTaskError wraps what went wrong inside the callee; when that is itself a Ray
    # system error (a nested call to a dead actor, a lost object) classify the cause.
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause
        if isinstance(cause, rex.RayError) and cause is not exc:
            if type(cause) is rex.RayError:
                # Ray could not pickle the inner error (ActorDiedError keeps a proto in its
                # args) and replaced it by a RayError carrying the traceback text.
                return NODE_LOST if _mentions_node_death(str(cause)) else CRASH
            return classify_ray_error(cause)
        return CRASH
    if isinstance(exc, PlacementTimeoutError):
        return PLACEMENT
    if isinstance(exc, rex.ActorUnavailableError):
        # Must precede RayActorError: it is a subclass, and transient.
        return UNAVAILABLE
    if isinstance(exc, rex.RayActorError):
        if exc.preempted:
            return PREEMPTION
        if _mentions_node_death(exc.error_msg):
            return NODE_LOST
        if _PG_REMOVED_MARKER in (exc.error_msg or "").lower():
            return PLACEMENT  # its learner group was released (or removed by someone else)
        return CRASH
    if isinstance(exc, rex.NodeDiedError | rex.LocalRayletDiedError):
        return NODE_LOST
    if isinstance(exc, rex.GetTimeoutError | TimeoutError):
        return HANG
    if isinstance(
        exc,
        rex.ActorPlacementGroupRemoved
        | rex.TaskPlacementGroupRemoved
        | rex.ActorUnschedulableError
        | rex.TaskUnschedulableError,
    ):
        return PLACEMENT
    if isinstance(exc, rex.ObjectLostError):
        # Includes OwnerDiedError, ObjectFetchTimedOutError, ObjectReconstructionFailedError.
        return OBJECT_LOST
    logger.debug("classify_ray_error: %s treated as a crash", type(exc).__name__)
    return CRASH


def _mentions_node_death(message: str | None) -> bool:
    text = (message or "").lower()
    return any(marker in text for marker in _NODE_DEATH_MARKERS)
