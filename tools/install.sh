#!/usr/bin/env bash
# Installs what the project needs on a fresh machine. Idempotent and quick when already installed.
#   bash tools/install.sh          # runtime: the main job on the embedded default
#   bash tools/install.sh --test   # plus test-only packages, bubblewrap (code sandbox) and SLURM (launcher tests)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# A plain `torch` requirement on a machine without CUDA pulls a multi-GB CUDA build: take the CPU
# build first when no GPU is visible and torch is missing.
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip_q torch; else pip_q torch==2.13.0; fi
fi
if [[ $want_test == 1 ]]; then
  pip_q -e ".[test]"
  # The Megatron-core backend's CPU tests: the parts we use need only einops; the wheel's declared
  # dependencies (nvidia-modelopt, tensorstore, wandb, ...) are GPU-cluster tooling never imported here.
  "$PY" -c "import megatron.core" 2>/dev/null || pip_q --no-deps megatron-core==0.11.0 einops
else
  pip_q -e .
fi

# System packages: bubblewrap isolates untrusted code in the code reward; slurm-wlm + munge run a real
# SLURM cluster on loopback for the multi-node launcher tests; chromium renders the run report in its browser
# test. Installed only when missing and root.
apt_pkgs=()
command -v bwrap >/dev/null 2>&1 || apt_pkgs+=(bubblewrap)
if [[ $want_test == 1 ]]; then
  command -v slurmctld >/dev/null 2>&1 || apt_pkgs+=(slurm-wlm munge)
  command -v chromium >/dev/null 2>&1 || apt_pkgs+=(chromium)
fi
if (( ${#apt_pkgs[@]} )); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: apt-get install ${apt_pkgs[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
  else
    echo "install.sh: not root; skipping system packages ${apt_pkgs[*]} (code sandbox / SLURM tests will say so)" >&2
  fi
fi
