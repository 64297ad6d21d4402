#!/bin/sh
# What `make test-image` needs on the host: podman with runc (and catatonit for its pods'
# infra containers), and mmdebstrap to make the base from Debian's packages. Installed
# with apt-get when missing and run as root (CI); otherwise named.
set -eu
missing=""
for tool in podman runc catatonit mmdebstrap; do
    command -v "$tool" > /dev/null 2>&1 || missing="$missing $tool"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null 2>&1; then
    echo "make test-image needs:$missing (Debian/Ubuntu: apt-get install$missing)" >&2
    exit 1
fi
echo "installing$missing"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc catatonit mmdebstrap > /dev/null
