#!/usr/bin/env bash
# Installs the Debian packages the tests drive, only those missing: chromium for the dashboard's
# browser test, qemu-user for the engine's run on an emulated AVX2-only CPU.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)
command -v qemu-x86_64 >/dev/null 2>&1 || missing+=(qemu-user)
[ ${#missing[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v chromium qemu-x86_64
