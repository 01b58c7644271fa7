"""OpenTelemetry metrics for vLLM speculative decoding.

Installed next to vLLM, the plugin activates in every engine process through
vLLM's ``vllm.general_plugins`` entry point, or through
``opentelemetry-instrument``; code can also call
``SpecDecodeInstrumentor().instrument(meter_provider=...)``.
"""

from otel_specdec.instrumentor import SpecDecodeInstrumentor
from otel_specdec.version import __version__

__all__ = ["SpecDecodeInstrumentor", "__version__"]
