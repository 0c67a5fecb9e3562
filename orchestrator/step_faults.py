"""What a request is told when its step, or its own part of a step, failed (issue 54): a fault belongs
to its sequence, and a failed step's message names the step and what happened, never a transport's
bare words ("Stream removed")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from moe_lightning.request import InvalidRequestError
from moe_lightning.service.errors import ServiceError, UnavailableError, status_for
from moe_lightning.step_protocol import SequenceFault, StepOutput, StepPlan

if TYPE_CHECKING:
    from orchestrator.batcher import Sequence

# what gpu_expert answers for a step that failed while the worker lives on: the step's requests end,
# the others and the workers' state stay. Any other code (UNAVAILABLE, DEADLINE_EXCEEDED, a restarted
# worker's FAILED_PRECONDITION) means the worker, or its state, is gone: the backend is re-wired.
STEP_FAILED_CODES = (
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


def worker_error(plan: StepPlan, exc: grpc.RpcError) -> ServiceError:
    """gpu_expert's answer to a failed Step as a domain error: lost (UNAVAILABLE) unless the worker
    said the step alone failed."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or code.name
    where = f"step {plan.step_id} ({plan.kind}, {plan.num_sequences} sequences)"
    if code in STEP_FAILED_CODES:
        return ServiceError(f"{where} failed in gpu_expert: {details}", code)
    return UnavailableError(f"{where} lost its backend: gpu_expert answered {code.name} ({details})")


def step_error(plan: StepPlan, exc: BaseException, lost: bool) -> ServiceError:
    """What each request of a failed step ends with."""
    if lost:
        return UnavailableError(
            f"{exc}; a backend service died or restarted during the step, the request was not completed, retry it"
        )
    text = str(exc) if f"step {plan.step_id} " in str(exc) else f"step {plan.step_id} ({plan.kind}) failed: {exc}"
    return ServiceError(f"{text}; the request was not completed", status_for(exc))


def sampling_faults(sequences: list[Sequence], out: StepOutput) -> list[tuple[Sequence, BaseException]]:
    """The sequences the head could not sample, each with its error: the client's 400 when its own
    controls caused it, else INTERNAL."""
    return [(s, _fault_error(out.faults[s.seq_id])) for s in sequences if s.seq_id in out.faults]


def _fault_error(fault: SequenceFault) -> ServiceError:
    code = grpc.StatusCode.INVALID_ARGUMENT if fault.invalid_argument else grpc.StatusCode.INTERNAL
    return ServiceError(fault.message, code)


def output_error(exc: Exception) -> ServiceError:
    """A sequence whose output could not be taken in (its detokenizer, stop strings, log-probabilities)."""
    if isinstance(exc, InvalidRequestError):
        return ServiceError(str(exc), grpc.StatusCode.INVALID_ARGUMENT)
    return ServiceError(f"internal error on this request's output: {exc!r}; the request was not completed")
