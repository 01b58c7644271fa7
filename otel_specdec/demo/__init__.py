"""The demo: ``otel-specdec demo`` and the tools it is made of.

Nothing here runs inside vLLM or is loaded by the plugin. It builds a tiny
model locally (``tiny_model``), runs real vLLM in a child process
(``engine_run``), receives the OTLP export on loopback (``receiver``) and
prints what it got next to vLLM's own counters (``run``). Its extra
dependencies come with the ``[demo]`` extra; the tests and ``bench/`` use
the same tools.
"""
