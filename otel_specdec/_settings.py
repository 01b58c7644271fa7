"""Read and check the standard ``OTEL_*`` export settings, once per process.

The OpenTelemetry SDK and exporters parse these variables themselves, but
they react to bad values in ways an operator cannot act on: some raise from
a constructor, some warn without naming the value, some print the value of
``OTEL_EXPORTER_OTLP_HEADERS`` (which holds credentials), some fail only at
every export. The plugin checks them first and reports each problem in one
line that names the variable.

* A value that decides where or how securely the data goes (exporter,
  protocol, endpoint, headers, certificates, insecure, compression) raises
  ``ConfigError``: the plugin does not export rather than guess.
* A tuning value (export interval and timeouts) falls back to its default
  with one error line, and exporting goes on.

Each OTLP setting has a metrics form, ``OTEL_EXPORTER_OTLP_METRICS_<NAME>``,
that wins over the general ``OTEL_EXPORTER_OTLP_<NAME>``, as in the SDK.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from otel_specdec import environment_variables as env_vars

__all__ = [
    "PROTOCOLS",
    "SHUTDOWN_TIMEOUT_ENV",
    "ConfigError",
    "ExportSettings",
    "env_flag",
    "env_value",
    "otlp_setting",
    "otlp_timeout_s",
    "read_settings",
    "redact_url",
    "shutdown_budget_s",
]

_logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
EXPORTERS = ("otlp", "prometheus", "console", "none")
COMPRESSIONS = ("gzip", "deflate", "none")

DEFAULT_PROTOCOL = "grpc"
DEFAULT_OTLP_TIMEOUT_S = 10.0
# An OTLP timeout this large can only be meant in milliseconds (the
# specification's unit): see otlp_timeout_s.
MILLISECONDS_FROM = 1000.0

# The plugin's whole shutdown (final metrics export, then spans): its own
# bound, whatever the export timeouts say. The ceiling keeps any setting
# within what orchestrators grant a stopping process.
SHUTDOWN_TIMEOUT_ENV = env_vars.OTEL_SPECDEC_SHUTDOWN_TIMEOUT
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
MAX_SHUTDOWN_TIMEOUT_S = 120.0
DEFAULT_INTERVAL_MS = 60_000.0
DEFAULT_EXPORT_TIMEOUT_MS = 30_000.0
DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464

# RFC 9110 token characters: what a header name may hold.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class ConfigError(ValueError):
    """A setting has a value the plugin cannot use; the message names it."""

    def __init__(self, variable: str, shown_value: str, expected: str) -> None:
        super().__init__(f"{variable}={shown_value} is not valid: expected {expected}")
        self.variable = variable


@dataclass(frozen=True)
class ExportSettings:
    """What the plugin's own provider is built from."""

    exporters: tuple[str, ...]
    protocol: str
    # Seconds the OTLP exporter may spend on one export, retries included.
    otlp_timeout_s: float
    interval_ms: float
    export_timeout_ms: float
    # Seconds the plugin's shutdown may take (final export, then spans).
    shutdown_budget_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # Where the engine serves /metrics with OTEL_METRICS_EXPORTER=prometheus;
    # each data-parallel rank adds its rank to the port.
    prometheus_host: str = DEFAULT_PROMETHEUS_HOST
    prometheus_port: int = DEFAULT_PROMETHEUS_PORT


def env_value(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def otlp_setting(name: str, signal: str = "METRICS") -> tuple[str, str] | None:
    """``(variable, value)`` of the effective OTLP setting ``name`` for
    ``signal`` (the signal's own variable wins over the general one), if set."""
    for variable in env_vars.otlp_variables(name, signal):
        value = env_value(variable)
        if value is not None:
            return variable, value
    return None


def redact_url(value: str) -> str:
    """``value`` without user info or query, which may carry credentials."""
    try:
        parts = urlsplit(value if "://" in value else "//" + value)
    except ValueError:
        return "<unparsable, not shown>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "?***" if parts.query else ""
    scheme = parts.scheme + "://" if "://" in value else ""
    return f"{scheme}{netloc}{parts.path}{query}"


def _exporters() -> tuple[str, ...]:
    raw = env_value(env_vars.OTEL_METRICS_EXPORTER) or "otlp"
    chosen = [name.strip().lower() for name in raw.split(",") if name.strip()]
    for name in chosen:
        if name not in EXPORTERS:
            raise ConfigError(env_vars.OTEL_METRICS_EXPORTER, repr(raw), " or ".join(EXPORTERS))
    return tuple(name for name in chosen if name != "none")


def _check_prometheus_package() -> None:
    try:
        import opentelemetry.exporter.prometheus  # noqa: F401
    except ImportError:
        raise ConfigError(
            env_vars.OTEL_METRICS_EXPORTER, "prometheus",
            "an installed opentelemetry-exporter-prometheus "
            "(pip install 'otel-specdec[prometheus]')",
        ) from None


def _prometheus_port() -> int:
    raw = env_value(env_vars.OTEL_EXPORTER_PROMETHEUS_PORT)
    if raw is None:
        return DEFAULT_PROMETHEUS_PORT
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(env_vars.OTEL_EXPORTER_PROMETHEUS_PORT, repr(raw),
                          "a port number, 1-65535")
    return int(raw)


def _protocol() -> str:
    setting = otlp_setting("PROTOCOL")
    if setting is None:
        return DEFAULT_PROTOCOL
    variable, value = setting
    if value not in PROTOCOLS:
        raise ConfigError(variable, repr(value), " or ".join(PROTOCOLS))
    return value


def _check_endpoint(protocol: str) -> None:
    setting = otlp_setting("ENDPOINT")
    if setting is None:
        return
    variable, value = setting
    schemes = "http://host[:port] or https://host[:port]"
    expected = schemes + (" (or host:port, which uses TLS)" if protocol == "grpc" else "")
    shown = repr(redact_url(value))
    if any(c.isspace() for c in value):
        raise ConfigError(variable, shown, expected + ", without spaces")
    has_scheme = "://" in value
    if has_scheme and value.split("://", 1)[0].lower() not in ("http", "https"):
        raise ConfigError(variable, shown, expected)
    if not has_scheme and protocol != "grpc":
        raise ConfigError(variable, shown, expected)
    try:
        parts = urlsplit(value if has_scheme else "//" + value)
        port = parts.port
    except ValueError:  # a port that is not a number in 0..65535
        raise ConfigError(variable, shown, expected + " with a numeric port") from None
    if not parts.hostname:
        raise ConfigError(variable, shown, expected + " with a host name")
    if not has_scheme and port is None:
        raise ConfigError(variable, shown, expected + " with a port")


def _check_headers() -> None:
    setting = otlp_setting("HEADERS")
    if setting is None:
        return
    variable, value = setting
    for number, item in enumerate(value.split(","), start=1):
        if not item.strip():
            continue
        name, sep, _ = item.partition("=")
        if not sep or not _HEADER_NAME.match(name.strip()):
            # Never the value: it usually holds an API key or a token.
            raise ConfigError(
                variable, f"<not shown, may hold credentials; entry {number} is malformed>",
                "comma-separated name=value pairs with names made of letters, digits and -",
            )


def _check_boolean(name: str) -> None:
    setting = otlp_setting(name)
    if setting is not None and setting[1].lower() not in ("true", "false"):
        raise ConfigError(setting[0], repr(setting[1]), "true or false")


def _check_compression() -> None:
    setting = otlp_setting("COMPRESSION")
    if setting is not None and setting[1].lower() not in COMPRESSIONS:
        raise ConfigError(setting[0], repr(setting[1]), " or ".join(COMPRESSIONS))


def _check_files() -> None:
    names = ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")
    settings = {name: otlp_setting(name) for name in names}
    for setting in settings.values():
        if setting is None:
            continue
        variable, path = setting
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(variable, repr(path), "a readable PEM file")
    key, cert = settings["CLIENT_KEY"], settings["CLIENT_CERTIFICATE"]
    if key is not None and cert is None:
        raise ConfigError(key[0], repr(key[1]), "a client certificate set with it "
                          "(OTEL_EXPORTER_OTLP[_METRICS]_CLIENT_CERTIFICATE)")
    if cert is not None and key is None:
        raise ConfigError(cert[0], repr(cert[1]), "a client key set with it "
                          "(OTEL_EXPORTER_OTLP[_METRICS]_CLIENT_KEY)")


def _positive_number(variable: str, default: float, unit: str, report: bool = True) -> float:
    raw = env_value(variable)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        if not report:
            return default
        _logger.error(
            "otel_specdec: %s=%r is not valid: expected a positive number of %s; using %g",
            variable, raw, unit, default,
        )
        return default
    return value


def otlp_timeout_s(signal: str = "METRICS", report: bool = True) -> float:
    """Seconds one OTLP export of ``signal`` may take.

    Read in seconds, as the Python SDK reads it, so that the plugin's
    exporters agree with the others in the process; but a value of 1000 or
    more is taken as milliseconds (the specification's unit), with one
    warning per variable. A bad value falls back to the default (with one
    error line when ``report``).
    """
    setting = otlp_setting("TIMEOUT", signal)
    if setting is None:
        return DEFAULT_OTLP_TIMEOUT_S
    variable, raw = setting
    value = _positive_number(variable, DEFAULT_OTLP_TIMEOUT_S, "seconds", report)
    if value < MILLISECONDS_FROM:
        return value
    if report and variable not in _unit_warned:
        _unit_warned.add(variable)
        _logger.warning(
            "otel_specdec: %s=%s: the OpenTelemetry specification reads this in milliseconds "
            "(%g s), the Python SDK in seconds (%g s, %.1f h). A value of %g or more can only "
            "be meant as milliseconds: the plugin's exporters use %g s (set %s=%g to say so "
            "and silence this). Exporters the plugin did not build may wait %g s; the "
            "plugin's shutdown stays bounded by %s.",
            variable, raw, value / 1000, value, value / 3600, MILLISECONDS_FROM, value / 1000,
            variable, value / 1000, value, SHUTDOWN_TIMEOUT_ENV,
        )
    return value / 1000


_unit_warned: set[str] = set()


def shutdown_budget_s(report: bool = True) -> float:
    """Seconds the plugin may add to a stopping engine, at most
    ``MAX_SHUTDOWN_TIMEOUT_S``; a bad value falls back to the default (with
    one error line when ``report``)."""
    value = _positive_number(SHUTDOWN_TIMEOUT_ENV, DEFAULT_SHUTDOWN_TIMEOUT_S, "seconds",
                             report)
    if value > MAX_SHUTDOWN_TIMEOUT_S:
        if report:
            _logger.error("otel_specdec: %s=%g is above the ceiling of %g seconds; using %g",
                          SHUTDOWN_TIMEOUT_ENV, value, MAX_SHUTDOWN_TIMEOUT_S,
                          MAX_SHUTDOWN_TIMEOUT_S)
        return MAX_SHUTDOWN_TIMEOUT_S
    return value


def env_flag(name: str, default: bool, consequence: str, report: bool = True) -> bool:
    """A true/false variable; unset or empty gives ``default``, and so does a
    bad value, with one error line saying ``consequence``."""
    value = (os.environ.get(name) or "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value and report:
        _logger.error("otel_specdec: %s=%r is not valid: expected true or false; %s",
                      name, value, consequence)
    return default


def read_settings() -> ExportSettings:
    """The checked settings; raises ``ConfigError`` for a value that stops export."""
    exporters = _exporters()
    protocol = _protocol() if "otlp" in exporters else DEFAULT_PROTOCOL
    if "otlp" in exporters:
        _check_endpoint(protocol)
        _check_headers()
        _check_boolean("INSECURE")
        _check_compression()
        _check_files()
    if "prometheus" in exporters:
        _check_prometheus_package()
    return ExportSettings(
        exporters=exporters,
        protocol=protocol,
        otlp_timeout_s=otlp_timeout_s() if "otlp" in exporters else DEFAULT_OTLP_TIMEOUT_S,
        interval_ms=_positive_number(
            env_vars.OTEL_METRIC_EXPORT_INTERVAL, DEFAULT_INTERVAL_MS, "milliseconds"),
        export_timeout_ms=_positive_number(
            env_vars.OTEL_METRIC_EXPORT_TIMEOUT, DEFAULT_EXPORT_TIMEOUT_MS, "milliseconds"),
        shutdown_budget_s=shutdown_budget_s(),
        prometheus_host=(env_value(env_vars.OTEL_EXPORTER_PROMETHEUS_HOST)
                         or DEFAULT_PROMETHEUS_HOST),
        prometheus_port=_prometheus_port() if "prometheus" in exporters
        else DEFAULT_PROMETHEUS_PORT,
    )
