#!/usr/bin/env bash
# Installs Debian's chromium for the dashboard's browser test, only when it is missing.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
export DEBIAN_FRONTEND=noninteractive
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium
