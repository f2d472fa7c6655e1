"""The errors rollfleet raises, in one place.

::

    RolloutError                     base of everything rollfleet raises
    ├── RequestError                 one request failed; the fleet is fine (recoverable)
    │   ├── InvalidRequest           bad input: malformed frame, wrong field type, unknown id
    │   ├── DuplicateRequest         a request with this id is already in flight
    │   ├── Overloaded               too many requests in flight for this client
    │   ├── Unsupported              the engine lacks this operation
    │   ├── EngineFailed             the engine raised while serving the request
    │   ├── WorkerLost               the worker serving it died and it was not resumed
    │   ├── ResumeExhausted          it was interrupted more often than allowed
    │   └── RequestTimeout           no answer within the deadline
    └── FleetError                   a fleet-wide operation failed, or the fleet is gone
        ├── WorkerStartError         a worker failed to start or register
        ├── WeightUpdateError        a weight update failed (the fleet serves on with the last
        │                            good weights, or a worker's initial ones: retry the update)
        └── FleetClosed              the fleet is shut down or shutting down

Every error that crosses the wire has a string ``code`` (see PROTOCOL.md); ``from_code``
turns a wire error back into the matching class.
"""

from __future__ import annotations

__all__ = [
    "RolloutError",
    "RequestError",
    "InvalidRequest",
    "DuplicateRequest",
    "Overloaded",
    "Unsupported",
    "EngineFailed",
    "WorkerLost",
    "ResumeExhausted",
    "RequestTimeout",
    "FleetError",
    "WorkerStartError",
    "WeightUpdateError",
    "FleetClosed",
    "from_code",
]


class RolloutError(Exception):
    """Base class. ``code`` is the wire error code."""

    code = "internal"

    def __init__(self, message: str = "", *, code: str | None = None, request_id: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.request_id = request_id


class RequestError(RolloutError):
    """One request or call failed; the fleet is fine."""

    code = "request_failed"


class InvalidRequest(RequestError):
    """Bad input: a malformed message, a wrong field type or value, an unknown request id or op."""

    code = "bad_message"


class DuplicateRequest(RequestError):
    """A request with this id is already in flight for this client."""

    code = "duplicate_request"


class Overloaded(RequestError):
    """This client has max_inflight_per_client requests in flight; retry later."""

    code = "overloaded"


class Unsupported(RequestError):
    """The engine lacks this operation (a control op, weight loading, LoRA)."""

    code = "unsupported"


class EngineFailed(RequestError):
    """The engine raised while serving the request or operation."""

    code = "engine_error"


class WorkerLost(RequestError):
    """The worker serving the request died and the request was not resumed."""

    code = "worker_lost"


class ResumeExhausted(RequestError):
    """The request was interrupted more than max_resume_attempts times."""

    code = "resume_exhausted"


class RequestTimeout(RequestError):
    """No answer within the deadline; a request is aborted on its worker."""

    code = "timeout"


class FleetError(RolloutError):
    """A fleet-wide operation failed, or the fleet is gone."""

    code = "fleet_error"


class WorkerStartError(FleetError):
    """A worker failed to start or register."""

    code = "worker_start_failed"


class WeightUpdateError(FleetError):
    """A weight update failed; the fleet serves on with the previous weights (see
    Supervisor.update_weights for a worker that had loaded part of the update)."""

    code = "weights_failed"


class FleetClosed(FleetError):
    """The fleet is shut down or shutting down."""

    code = "shutting_down"


# Wire codes -> classes. Several codes share InvalidRequest: they are all "your input was bad".
_BY_CODE: dict[str, type[RolloutError]] = {
    "bad_frame": InvalidRequest,
    "bad_message": InvalidRequest,
    "unknown_type": InvalidRequest,
    "bad_field": InvalidRequest,
    "too_large": InvalidRequest,
    "version_mismatch": InvalidRequest,
    "unknown_request": InvalidRequest,
    "unknown_op": InvalidRequest,
    "duplicate_request": DuplicateRequest,
    "overloaded": Overloaded,
    "unsupported": Unsupported,
    "engine_error": EngineFailed,
    "worker_lost": WorkerLost,
    "resume_exhausted": ResumeExhausted,
    "timeout": RequestTimeout,
    "request_failed": RequestError,
    "worker_start_failed": WorkerStartError,
    "weights_failed": WeightUpdateError,
    "shutting_down": FleetClosed,
    "fleet_error": FleetError,
    "internal": RolloutError,
}

ERROR_CODES = tuple(_BY_CODE)


def from_code(code: str, message: str, request_id: str | None = None) -> RolloutError:
    """Build the exception matching a wire error code (unknown codes -> RolloutError)."""
    cls = _BY_CODE.get(code, RolloutError)
    return cls(message, code=code, request_id=request_id)
