"""Which requests keep per-request detail while request spans are on.

A request's span is sampled (or not) when it is built, after the request
finished; its detail must be kept from its first draft on. The tracer
provider's sampler is read once, and where its decision follows from a
request's trace context alone (``always_off``, ``always_on``, parent-based
samplers, whose default delegates follow the parent's sampled flag), a
request whose span cannot be sampled keeps no detail at all: with
``always_off``, or a parent-based sampler and unsampled parents, the
accounting is the same as with spans off. Where the decision depends on the
trace id the SDK draws when it builds the span (ratio samplers, for
requests without a parent) or on a sampler this module does not know, the
detail is kept and the sampler decides when the span is built.

``SamplingPlan.keeps`` is the one place a request's trace context is read
for it, on both accounting paths (the C pass asks it, once per step, about
the requests the step first schedules). It checks the ``traceparent``
header with the W3C grammar itself rather than through the SDK's
propagator, which builds a context per call (several microseconds, on the
scheduler's thread); a test holds it to the propagator's answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import sampling

__all__ = ["KEEP_ALL", "SamplingPlan", "plan_for"]

# W3C trace context: version-trace_id-parent_id-flags, lower-case hex;
# later versions may append fields after another "-".
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16
_ODD_HEX = frozenset("13579bdf")
# Longer values are ignored by recent SDK propagators (1.45) and read by
# older ones (1.28): their detail is kept, and the sampler decides.
_TRACEPARENT_MAX_LENGTH = 512


class _Undecided(Exception):
    """The parent depends on the SDK version: keep the detail."""


def _parent_sampled(trace_headers: Mapping[str, Any]) -> bool | None:
    """The remote parent's sampled flag, or None where there is no valid parent."""
    value = trace_headers.get("traceparent")
    if value.__class__ is not str:
        if value is None:
            return None
        value = next(iter(value), None)  # a multi-valued header: its first value
        if not isinstance(value, str):
            return None
    if len(value) > _TRACEPARENT_MAX_LENGTH:
        raise _Undecided
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if (trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID or version == "ff"
            or (version == "00" and rest)):
        return None
    return flags[1] in _ODD_HEX  # the sampled bit is the flags' lowest


@dataclass(frozen=True)
class SamplingPlan:
    """Whether a request's detail is kept, by the kind of its trace context."""

    root: bool
    sampled_parent: bool
    unsampled_parent: bool

    def keeps_none(self) -> bool:
        return not (self.root or self.sampled_parent or self.unsampled_parent)

    def keeps_all(self) -> bool:
        return self.root and self.sampled_parent and self.unsampled_parent

    def keeps(self, trace_headers: Mapping[str, Any] | None) -> bool:
        """The plan for a request with these trace headers."""
        if trace_headers and not self.keeps_all():
            try:
                sampled = _parent_sampled(trace_headers)
            except Exception:  # unreadable, or read differently by SDK versions:
                return True   # kept, and the sampler decides when the span is built
            if sampled is not None:
                return self.sampled_parent if sampled else self.unsampled_parent
        return self.root


KEEP_ALL = SamplingPlan(True, True, True)


def _static_decision(sampler: Any) -> bool | None:
    """Whether ``sampler`` samples every span (True), none (False), or it depends."""
    cls = type(sampler)
    if isinstance(sampler, sampling.StaticSampler) and (
            cls.should_sample is sampling.StaticSampler.should_sample):
        return getattr(sampler, "_decision", None) is not sampling.Decision.DROP
    if isinstance(sampler, sampling.TraceIdRatioBased) and (
            cls.should_sample is sampling.TraceIdRatioBased.should_sample):
        rate = getattr(sampler, "rate", None)
        if rate is not None and rate <= 0:
            return False
        if rate is not None and rate >= 1:
            return True
    return None


def plan_for(sampler: Any) -> SamplingPlan:
    """The plan for a tracer provider's sampler (unknown parts keep detail)."""
    def keep(part: Any) -> bool:
        return _static_decision(part) is not False

    if isinstance(sampler, sampling.ParentBased) and (
            type(sampler).should_sample is sampling.ParentBased.should_sample):
        parts = [getattr(sampler, name, None) for name in
                 ("_root", "_remote_parent_sampled", "_remote_parent_not_sampled")]
        if all(part is not None for part in parts):
            return SamplingPlan(*(keep(part) for part in parts))
        return KEEP_ALL
    decision = _static_decision(sampler)
    return KEEP_ALL if decision is not False else SamplingPlan(False, False, False)
