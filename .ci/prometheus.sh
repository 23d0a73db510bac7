#!/usr/bin/env bash
# Install a real Prometheus from the system's packages for tests/test_prometheus.py.
# Never fatal: where it cannot be installed, that test skips and says why.
set -u
if command -v prometheus >/dev/null 2>&1; then
  prometheus --version 2>&1 | head -1
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "prometheus.sh: not root and no passwordless sudo; the Prometheus test will skip" >&2; exit 0; fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "prometheus.sh: no apt-get here; the Prometheus test will skip" >&2; exit 0
fi
# the Debian package's postinst tries to start a service; without an init system that fails
# harmlessly, and the binary is all the test needs
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || echo "prometheus.sh: apt-get update failed" >&2
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
  || echo "prometheus.sh: apt-get install prometheus failed; the Prometheus test will skip" >&2
command -v prometheus >/dev/null 2>&1 && prometheus --version 2>&1 | head -1
exit 0
