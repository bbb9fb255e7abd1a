#!/usr/bin/env bash
# Installs what kvq needs to build, test and benchmark on Debian 12 (bookworm), and does
# nothing when everything is already present. Needs root (or sudo) only when something is missing.
# clang and its runtime libraries build the libFuzzer targets (the test-fuzz workflow);
# clang-format-14 checks that the sources follow .clang-format (a test).
set -euo pipefail

# `--aarch64` adds Debian's AArch64 cross compiler and qemu-user for the aarch64 preset.
packages=(g++ cmake make libeigen3-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev clang libclang-rt-14-dev clang-format-14)
for arg in "$@"; do
  case "$arg" in
    --aarch64) packages+=(g++-aarch64-linux-gnu qemu-user) ;;
    *) echo "install-deps: unknown option '$arg' (expected --aarch64)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
