#!/usr/bin/env bash
# Unpack Debian's arm64 Python (3.11, with the C libraries it loads) into a
# folder, for qemu-aarch64-static -L <folder> <folder>/usr/bin/python3.11.
# Nothing is installed: the packages are downloaded and extracted, because
# Debian's python3:arm64 cannot sit beside the machine's own python3.
# Usage: scripts/arm64-python.sh DEST   (skipped where DEST already has it)
set -euo pipefail
DEST=${1:?usage: arm64-python.sh DEST}
if [ -x "$DEST/usr/bin/python3.11" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -qq
debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
chmod 777 "$debs"  # apt's download sandbox user writes here
packages=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 zlib1g
          libexpat1 libffi8 libgcc-s1 libssl3 libbz2-1.0 liblzma5 libuuid1 libcrypt1)
(cd "$debs" && apt-get download -qq "${packages[@]/%/:arm64}")
mkdir -p "$DEST"
for deb in "$debs"/*.deb; do
  dpkg-deb -x "$deb" "$DEST"
done
echo "arm64-python: $DEST/usr/bin/python3.11"
