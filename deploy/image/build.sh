#!/usr/bin/env bash
# Build vmpin's node-agent image from this repository, offline from any container registry:
# a Debian 12 root made by mmdebstrap from Debian's packages, vmpin installed in a venv in it
# by pip from PyPI, imported into podman.  One command, from a clean clone:
#
#     deploy/image/build.sh            # -> localhost/vmpin:<version>-<input hash>, and :latest
#
# Reproducible where the inputs are: pinned Python packages (deploy/image/requirements.txt),
# SOURCE_DATE_EPOCH from the last commit (file times in the tar), no docs, man pages or
# locales, no apt lists or pip caches; the Debian packages are bookworm's current ones, and
# their versions are recorded in the image's /usr/share/vmpin/packages.txt.  An image whose
# input hash is already in podman is not built again (--force builds anyway).
set -euo pipefail
cd "$(dirname "$0")/../.."

force=0
[ "${1:-}" = "--force" ] && force=1

for tool in mmdebstrap podman python3; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done

version=$(python3 -c 'import re;print(re.search(r"^version = \"(.+)\"", open("pyproject.toml").read(), re.M).group(1))')
# what the image is made of: vmpin's sources, its packaging, the pins, this script
hash=$( (git ls-files -z vmpin bin pyproject.toml README.md deploy/image 2>/dev/null \
         | xargs -0 sha256sum) | sha256sum | cut -c1-12)
tag="localhost/vmpin:${version}-${hash}"
if [ "$force" = 0 ] && podman image exists "$tag"; then
    echo "$tag"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)

# vmpin as a wheel, and the pinned wheels of what it needs, fetched here with this machine's
# pip (its index, proxy and certificates), then installed in the root with no index at all:
# the root needs no network and no trust store of the build host.  Debian 12's python3 is
# 3.11: the wheels are chosen for it, whatever python3 runs this script.
python3 -m pip wheel -q --no-deps -w "$work/wheels" . >/dev/null
python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    -c deploy/image/requirements.txt -d "$work/wheels" "$(ls "$work"/wheels/vmpin-*.whl)[kube]" \
    >"$work/pip.log" 2>&1 || { tail -20 "$work/pip.log" >&2; exit 1; }

mmdebstrap --variant=minbase \
    --include=python3,python3-venv,python3-libvirt,ca-certificates,util-linux \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='mkdir -p "$1/tmp/vmpin-build"' \
    --customize-hook="copy-in $work/wheels /tmp/vmpin-build" \
    --customize-hook='chroot "$1" python3 -m venv --system-site-packages /opt/vmpin' \
    --customize-hook='chroot "$1" env -i PATH=/usr/bin:/bin /opt/vmpin/bin/pip install -q --no-index --no-cache-dir --no-compile --disable-pip-version-check --find-links /tmp/vmpin-build/wheels "vmpin[kube]"' \
    --customize-hook='chroot "$1" /opt/vmpin/bin/vmpin --version' \
    --customize-hook='chroot "$1" /opt/vmpin/bin/pip uninstall -q -y pip setuptools wheel 2>/dev/null || true' \
    --customize-hook='mkdir -p "$1/usr/share/vmpin"; chroot "$1" dpkg-query -W > "$1/usr/share/vmpin/packages.txt"; ls "$1"/tmp/vmpin-build/wheels >> "$1/usr/share/vmpin/packages.txt"' \
    --customize-hook='rm -rf "$1/tmp/vmpin-build" "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$work/root.tar" >"$work/mmdebstrap.log" 2>&1 \
    || { tail -20 "$work/mmdebstrap.log" >&2; exit 1; }

podman import -q \
    --change 'ENTRYPOINT ["/opt/vmpin/bin/vmpin"]' \
    --change 'CMD ["serve"]' \
    --change 'ENV PATH=/opt/vmpin/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'USER root' \
    --change "LABEL org.opencontainers.image.title=vmpin" \
    --change "LABEL org.opencontainers.image.version=${version}" \
    --change "LABEL org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    --change "LABEL org.opencontainers.image.source=deploy/image/build.sh" \
    --change "LABEL org.opencontainers.image.licenses=Apache-2.0" \
    --change "LABEL io.vmpin.inputs=${hash}" \
    "$work/root.tar" "$tag" >/dev/null
podman tag "$tag" localhost/vmpin:latest
echo "$tag"
