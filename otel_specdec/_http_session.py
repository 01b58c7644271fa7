"""A ``requests`` session for the OTLP/HTTP exporter that keeps its CA file.

(Listed with every other patch in ``otel_specdec._patches``.)

Why: from the SDK release whose HTTP exporter moved to a transport object
(1.4x), the exporter sets the CA file from ``OTEL_EXPORTER_OTLP_CERTIFICATE``
as ``session.verify`` and no longer passes it per request. ``requests`` then
lets ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` from the environment override
the session's value (psf/requests#3829), so in any container that sets those
(many base images do) the collector's certificate is checked against the
system bundle and every export fails.

How: the session keeps an explicitly configured CA path over the
environment's bundle; everything else (proxies, per-request values) is
``requests``' own behaviour.

When it can go: once the exporter passes ``verify`` per request again or
``requests`` prefers ``session.verify``.
"""

from __future__ import annotations

from typing import Any

import requests

__all__ = ["CaPinnedSession"]


class CaPinnedSession(requests.Session):
    """``requests.Session`` whose ``verify`` path wins over the environment."""

    def merge_environment_settings(
        self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> dict[str, Any]:
        merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if verify is None and isinstance(self.verify, str):
            merged["verify"] = self.verify
        return merged
