#!/usr/bin/env bash
# Builds the environment image the tests and demos use: Debian bookworm (minbase) with
# Python 3, pytest and git from Debian's packages, working directory /workspace.
#
#   scripts/build_test_image.sh OUT_DIR
#     OUT_DIR/oci            an OCI image layout, tag `bookworm`
#     OUT_DIR/polar-test.tar the same image as a docker archive (polar-test:bookworm)
#
# Needs mmdebstrap, umoci and skopeo (scripts/install.sh installs them as root), a Debian
# mirror, and root or user namespaces (mmdebstrap's unshare mode). Idempotent: a finished
# build is stamped with this script's sha256 and not redone. Prints the image's digest (the
# sha256 of its config: what polar_mitm.rollout.images keys its cache by) on stdout.
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR}
SELF=$(sha256sum "$0" | cut -d' ' -f1)
STAMP="$OUT/.stamp"
MIRROR=${POLAR_DEBIAN_MIRROR:-http://deb.debian.org/debian}

digest() { echo "sha256:$(skopeo inspect --config --raw "oci:$OUT/oci:bookworm" | sha256sum | cut -d' ' -f1)"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SELF" ] && [ -f "$OUT/oci/index.json" ] && [ -f "$OUT/polar-test.tar" ]; then
  digest
  exit 0
fi
for tool in mmdebstrap umoci skopeo; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done

mkdir -p "$OUT"
WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Docs, man pages and translations out: a smaller image, nothing a test reads.
echo "building the rootfs (mmdebstrap bookworm)..." >&2
mmdebstrap --variant=minbase --include=python3,python3-pytest,git,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='mkdir -p "$1/workspace"' \
  bookworm "$WORK/rootfs.tar" "$MIRROR" >&2

echo "packing it as an OCI image (umoci)..." >&2
umoci init --layout "$WORK/oci"
umoci new --image "$WORK/oci:bookworm"
umoci raw add-layer --image "$WORK/oci:bookworm" --history.created_by "mmdebstrap bookworm" "$WORK/rootfs.tar"
umoci config --image "$WORK/oci:bookworm" --config.workingdir=/workspace \
  --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env=LANG=C.UTF-8 --config.cmd=/bin/bash
umoci gc --layout "$WORK/oci"      # the blobs of the intermediate images
skopeo copy --quiet "oci:$WORK/oci:bookworm" "docker-archive:$WORK/polar-test.tar:polar-test:bookworm" >&2

rm -rf "$OUT/oci" "$OUT/polar-test.tar" "$STAMP"
mv "$WORK/oci" "$OUT/oci"
mv "$WORK/polar-test.tar" "$OUT/polar-test.tar"
echo "$SELF" > "$STAMP"
digest
