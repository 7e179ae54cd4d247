#!/usr/bin/env bash
# A Debian bookworm base image with Python 3.11, made from Debian's archive alone (debootstrap, then `docker import`),
# for machines that reach no image registry: `base-image.sh TAG` (default specserve-base:bookworm). Nothing is done
# when the engine has the tag already. Build the project's image on it with --build-arg BASE_IMAGE=TAG.
set -euo pipefail
TAG=${1:-specserve-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" > /dev/null 2>&1; then exit 0; fi
command -v debootstrap > /dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap > /dev/null; }
root=$(mktemp -d /var/tmp/specserve-base.XXXXXX)
cleanup() {
    # debootstrap mounts /proc and /sys in the new root while it works; one cut short may leave them: unmount first.
    awk -v dir="$root/" 'index($2, dir) == 1 { print $2 }' /proc/mounts | sort -r | while read -r mount; do
        umount "$mount" 2> /dev/null || umount -l "$mount"
    done
    rm -rf "$root" "$root.log"
}
trap cleanup EXIT
# python3-venv: the image installs into a venv (Debian's own Python refuses `pip install` outside one).
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" > "$root.log" 2>&1 \
    || { tail -n 30 "$root.log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$TAG" > /dev/null
