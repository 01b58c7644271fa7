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

The C pass applies the same plan (``_rowscan`` parses the ``traceparent``
header itself); ``SamplingPlan.keeps`` is the reference, through the SDK's
own propagator, and a test holds the two to the same answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["KEEP_ALL", "SamplingPlan", "plan_for"]

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class SamplingPlan:
    """Whether a request's detail is kept, by the kind of its trace context.

    The C pass is given ``as_dict()`` and takes each kind by its field name.
    """

    root: bool
    sampled_parent: bool
    unsampled_parent: bool

    def keeps_none(self) -> bool:
        return not (self.root or self.sampled_parent or self.unsampled_parent)

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)

    def keeps(self, trace_headers: Mapping[str, Any] | None) -> bool:
        """The plan for a request with these trace headers."""
        if self.root and self.sampled_parent and self.unsampled_parent:
            return True
        if trace_headers:
            context = trace.get_current_span(
                _PROPAGATOR.extract(dict(trace_headers))).get_span_context()
            if context.is_valid:
                return self.sampled_parent if context.trace_flags.sampled else (
                    self.unsampled_parent)
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
