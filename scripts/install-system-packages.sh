#!/usr/bin/env bash
# Debian packages the tests use. Needs root (or sudo); each is skipped where
# it is already there.
#   - prometheus (server and promtool): the rule, dashboard and scrape tests;
#   - qemu-user-static: runs the aarch64 wheel's C pass (tests/test_dist.py)
#     under an arm64 Python, which scripts/arm64-python.sh unpacks into a
#     folder of the project's (never installed system-wide: Debian's python3
#     for arm64 would replace the machine's own).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
missing=()
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  missing+=(prometheus)
fi
if ! command -v qemu-aarch64-static >/dev/null; then
  missing+=(qemu-user-static)
fi
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The package may start its own service; the tests run their own servers.
if command -v service >/dev/null; then $SUDO service prometheus stop >/dev/null 2>&1 || true; fi
command -v promtool qemu-aarch64-static
