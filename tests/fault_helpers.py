"""What the failure tests need around the engine: free ports, TLS
certificates, an engine child driven phase by phase."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine_child import ENTRY, PHASE_PREFIX, RESULT_PREFIX

from otel_specdec.demo.engine_run import KV_CACHE_BYTES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain_lines(stream: Any) -> list[str]:
    """The lines of ``stream``, collected by a thread (a child's full pipe
    would block it)."""
    lines: list[str] = []

    def drain() -> None:
        for line in stream:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return lines


def make_tls_files(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client
    certificate, all signed by the CA; PEM file paths by role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def builder(subject: str, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (builder("otel-specdec test CA", name("otel-specdec test CA"), ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=False, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    # Strict verifiers (OpenSSL's X509_STRICT, used by urllib3 2) want the
    # extensions a real CA has: key usage and key identifiers.
    ca_key_id = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    files: dict[str, str] = {}

    def write(role: str, data: bytes) -> None:
        path = directory / f"{role}.pem"
        path.write_bytes(data)
        files[role] = str(path)

    write("ca", ca_cert.public_bytes(serialization.Encoding.PEM))
    for role, usage, sans in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("otel-specdec-client")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (builder(role, ca_cert.subject, key.public_key())
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(ca_key_id, critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(f"{role}_cert", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{role}_key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return files


class EngineChild:
    """``engine_child`` in a child process, paused between phases.

    At each pause the child reports vLLM's counters so far; ``proceed()``
    lets it generate the next phase; ``result()`` waits for the end.
    """

    def __init__(self, config: dict[str, Any], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *ENTRY, json.dumps(config)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = drain_lines(self.proc.stderr)

    def _next_marked_line(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith((PHASE_PREFIX, RESULT_PREFIX)):
                return line
        raise RuntimeError(f"engine child ended early: {''.join(self.stderr)[-6000:]}")

    def wait_pause(self) -> dict[str, Any]:
        """vLLM's counters at the pause."""
        line = self._next_marked_line()
        assert line.startswith(PHASE_PREFIX), line
        return json.loads(line[len(PHASE_PREFIX):].split(" ", 1)[1])

    def proceed(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 300) -> dict[str, Any]:
        line = self._next_marked_line()
        assert line.startswith(RESULT_PREFIX), line
        self.proc.wait(timeout=timeout)
        return json.loads(line[len(RESULT_PREFIX):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without OTEL_* or VLLM_PLUGINS settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OTEL_") and k != "VLLM_PLUGINS"}
    env.update(extra)
    return env


class ApiServer:
    """vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``:
    the ``vllm serve`` script fails with the CPU build's distribution name)."""

    def __init__(self, model: str, speculative_config: dict[str, Any], env: dict[str, str],
                 *extra_args: str) -> None:
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "512",
             "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.15",
             "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
             "--speculative-config", json.dumps(speculative_config), *extra_args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.stderr = drain_lines(self.proc.stderr)

    def log_tail(self, chars: int = 6000) -> str:
        return "".join(self.stderr)[-chars:]

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log_tail()
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=2)
                return
            except OSError:
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(1)

    def complete(self, prompt: str, max_tokens: int = 32, headers: dict[str, str] | None = None,
                 **fields: Any) -> dict[str, Any]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, **fields}).encode()
        request = urllib.request.Request(f"{self.base}/v1/completions", body,
                                         {"Content-Type": "application/json", **(headers or {})})
        return json.loads(urllib.request.urlopen(request, timeout=120).read())

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"{self.base}/metrics", timeout=10).read().decode()

    def terminate(self, timeout: float = 60) -> float:
        """SIGTERM, as an orchestrator stops the server; seconds until it exited."""
        stopped = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return time.monotonic() - stopped

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def prometheus_counters(text: str) -> dict[str, Any]:
    """vLLM's own spec-decode counters from its /metrics page, summed over engines."""
    def value(name: str, labels: str = "") -> int:
        pattern = rf"^{re.escape(name)}_total\{{[^}}]*{labels}[^}}]*\}} ([0-9.e+]+)$"
        return sum(int(float(v)) for v in re.findall(pattern, text, re.MULTILINE))

    per_pos: list[int] = []
    while f'position="{len(per_pos)}"' in text:
        per_pos.append(value("vllm:spec_decode_num_accepted_tokens_per_pos",
                             f'position="{len(per_pos)}"'))
    return {"drafts": value("vllm:spec_decode_num_drafts"),
            "draft_tokens": value("vllm:spec_decode_num_draft_tokens"),
            "accepted_tokens": value("vllm:spec_decode_num_accepted_tokens"),
            "accepted_per_pos": per_pos}
