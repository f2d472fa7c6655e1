"""What a caller gets back from a generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..transport.messages import Result

__all__ = ["GenerationResult", "StreamChunk"]


@dataclass(slots=True, kw_only=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    """Every generated token, across all resumed segments."""
    finish_reason: str
    """'stop', 'length' or 'abort'."""
    logprobs: list[float] | None = None
    weight_versions: list[int] = field(default_factory=list)
    """Weight version of each segment that produced tokens, in order."""
    weight_version_starts: list[int] = field(default_factory=list)
    """Beside ``weight_versions``: the index in ``token_ids`` where each segment begins."""
    num_preemptions: int = 0
    """How often it was interrupted (weight update, dead worker) to be resumed."""
    worker: str = ""
    """The worker it ran on last (after a resume, the one it was resumed on); "" if none."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: 'total', 'queue', 'first_token' (from the fleet's receipt), 'worker' (spent on
    workers, all attempts): total - worker is the fleet's own share (PROTOCOL.md 4.2)."""

    @property
    def min_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def max_version(self) -> int | None:
        return max(self.weight_versions) if self.weight_versions else None

    def token_weight_versions(self) -> list[int]:
        """The weight version that produced each token, one per token of ``token_ids``
        (e.g. for an off-policy correction on a partial rollout). Raises ValueError when the
        result does not say where its segments begin (a peer that does not send
        ``weight_version_starts``) and has more than one segment."""
        versions, starts, n = self.weight_versions, self.weight_version_starts, len(self.token_ids)
        if not versions or not n:
            return []
        if len(starts) != len(versions):
            if len(versions) == 1:
                return [versions[0]] * n
            raise ValueError(f"result {self.request_id!r} has {len(versions)} segments "
                             f"and {len(starts)} segment starts")
        out: list[int] = []
        for i, version in enumerate(versions):
            end = starts[i + 1] if i + 1 < len(starts) else n
            out.extend([version] * (min(end, n) - len(out)))
        return out

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_message(cls, msg: Result, *, copy: bool = True) -> "GenerationResult":
        """The result a ``result`` message describes. With ``copy=False`` it takes the
        message's lists and dict as its own: only for a message nothing else will read."""
        if copy:
            return cls(
                request_id=msg.id,
                token_ids=list(msg.token_ids),
                finish_reason=msg.finish_reason,
                logprobs=list(msg.logprobs) if msg.logprobs is not None else None,
                weight_versions=list(msg.weight_versions),
                weight_version_starts=list(msg.weight_version_starts),
                num_preemptions=msg.num_preemptions,
                worker=msg.worker,
                timings=dict(msg.timings),
            )
        return cls(
            request_id=msg.id,
            token_ids=msg.token_ids,
            finish_reason=msg.finish_reason,
            logprobs=msg.logprobs,
            weight_versions=msg.weight_versions,
            weight_version_starts=msg.weight_version_starts,
            num_preemptions=msg.num_preemptions,
            worker=msg.worker,
            timings=msg.timings,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "weight_versions": self.weight_versions,
            "weight_version_starts": self.weight_version_starts,
            "num_preemptions": self.num_preemptions,
            "worker": self.worker,
            "timings": self.timings,
        }


@dataclass(slots=True)
class StreamChunk:
    """New tokens of a streamed request."""

    token_ids: list[int]
    logprobs: list[float] | None
    weight_version: int
