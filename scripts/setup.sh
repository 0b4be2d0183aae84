#!/usr/bin/env bash
# Everything the tests and the rehearsal need on a fresh Debian/Ubuntu machine, idempotent.
# Debian packages: Docker (one daemon per simulated node), docker-registry (the image registry the
# simulated nodes pull from), sshd, iproute2 (namespaces), debootstrap (the rehearsal image),
# netplan.io (renders the fabric netplan file in tests), socat (the raw stream the copy benchmark
# compares with), nftables and iptables (network.guard writes its rules with whichever a node has;
# the simulated nodes are this machine's namespaces, so both are tested here). Python: a venv with requirements-dev.txt.
# Go (1.26, on the machine already), xz-utils and patch: the Pulumi CLI, its language host and the two provider
# plugins, built from source (scripts/toolchain.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(docker.io docker-registry openssh-server openssh-client iproute2 iptables util-linux debootstrap
          netplan.io python3-venv ca-certificates procps iputils-ping socat nftables xz-utils patch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then echo "setup: run as root to install: ${missing[*]}" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# `--packages`: the Debian packages only (CI starts the toolchain's Go build as soon as they are there).
[ "${1:-}" = "--packages" ] && exit 0

if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
fi
stamp=venv/.requirements.sha256
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  venv/bin/pip install -q --upgrade pip
  venv/bin/pip install -q -r requirements-dev.txt
  echo "$want" > "$stamp"
fi

# `--no-toolchain`: what needs no Pulumi CLI (./run-tests --fast; CI while the toolchain builds beside it).
[ "${1:-}" = "--no-toolchain" ] && exit 0
command -v go >/dev/null 2>&1 || export PATH="$PATH:/usr/local/go/bin"  # Go's own tarball location
if ! command -v go >/dev/null 2>&1; then
  echo "setup: the rehearsal builds the Pulumi CLI and plugins with Go 1.26 (https://go.dev/dl); 'go' is not on PATH" >&2
  exit 1
fi
bash scripts/toolchain.sh
