#!/bin/sh
# A stand-in for the real base image (pytorch/pytorch, docker/Dockerfile's BASE) where that
# cannot be pulled: Debian bookworm's Python 3.11 in a virtual environment at /opt/python,
# first on PATH as the real base's Python is, holding the CPU torch this machine's venv holds
# (`make install`) and what that torch needs, as the real base holds its own, and Python's C
# headers, as the real base's conda Python has them (torch.compile's CPU kernels include
# Python.h). No LANG or LC_ALL: the real base sets neither (pytorch/pytorch's Dockerfile), and
# Python coerces the C locale to UTF-8 itself (PEP 538). What a stand-in cannot tell: CUDA, and
# the real base's own Python and torch.
#
#   docker/standin-base.sh ENGINE TAG TORCH_WHEEL [CA_BUNDLE]
#
# mmdebstrap builds the root file system as a tarball (it needs root, or user namespaces), the
# engine imports it with the ENV a base sets, and torch is installed in a container of it (its
# dependencies from the package index, through CA_BUNDLE where TLS is intercepted), committed
# as TAG. docker and podman both have import, run and commit.
set -eu
engine=$1 tag=$2 wheel=$3 ca=${4:-}
[ -f "$wheel" ] || { echo "standin-base.sh: no torch wheel at $wheel" >&2; exit 1; }
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")  # a volume's source is a path
work=$(mktemp -d)
rootfs="$tag-rootfs" builder="smpipe-standin-$$"
trap '"$engine" rm -f "$builder" >/dev/null 2>&1; "$engine" rmi -f "$rootfs" >/dev/null 2>&1; rm -rf "$work"' EXIT
mmdebstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    --customize-hook='chroot "$1" env -i /usr/bin/python3 -m venv /opt/python' \
    bookworm "$work/rootfs.tar" http://deb.debian.org/debian
"$engine" import \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$work/rootfs.tar" "$rootfs"
name=$(basename "$wheel")
cert=
if [ -n "$ca" ] && [ -s "$ca" ]; then cert="--volume $ca:/tmp/ca.crt:ro"; fi
# shellcheck disable=SC2086 # $cert is two words or none
"$engine" run --name "$builder" --volume "$wheel:/tmp/$name:ro" $cert "$rootfs" \
    sh -c "pip install --no-cache-dir \$( [ -f /tmp/ca.crt ] && echo --cert /tmp/ca.crt ) /tmp/$name"
"$engine" commit "$builder" "$tag" >/dev/null
echo "stand-in base $tag: $("$engine" run --rm "$tag" python3 -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
