#!/usr/bin/env bash
# Debian packages the tests use: prometheus (server and promtool) for the
# rule, dashboard and scrape tests. Needs root (or sudo); skipped where the
# binaries are already there.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start its own service; the tests run their own servers.
if command -v service >/dev/null; then $SUDO service prometheus stop >/dev/null 2>&1 || true; fi
command -v promtool
