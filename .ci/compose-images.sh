#!/usr/bin/env bash
# Builds the images of compose.yaml's `cpu` profile (deploy/Dockerfile, deploy/Dockerfile.cpu-engine)
# in the daemon on DOCKER_HOST, on a machine that reaches no image registry. Run it under
# .ci/with-docker.sh, which owns the daemon and removes everything it holds:
#   bash .ci/with-docker.sh bash .ci/compose-images.sh [CACHE_DIR]
# then tests/test_compose_cpu.py brings the profile up and answers the README example through it.
#
# Stand-ins, in the throwaway daemon only: `python:3.11-slim` is a Debian bookworm minbase with
# Debian's python3 and pip (debootstrap from this machine's apt mirror); the CPU torch index the
# engine image installs from is this machine's wheels served on loopback. The builds use the host
# network (the daemon forwards nothing) and this machine's CA bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DOCKER_HOST:?run under .ci/with-docker.sh}"

now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
cache=${1:-$(mktemp -d "${TMPDIR:-/tmp}/openjev-images.XXXXXX")}
mkdir -p "$cache"
index_pid=""
trap '[ -z "$index_pid" ] || kill "$index_pid" 2>/dev/null || true' EXIT
started=$(now)

# 1. The base image.
rootfs_tar="$cache/python-3.11-bookworm.tar"
if [ ! -f "$rootfs_tar" ]; then
    command -v debootstrap >/dev/null || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    }
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
    rootfs="$cache/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$rootfs" "$mirror" \
        >"$cache/debootstrap.log"
    # What the official image offers and the Dockerfiles use: `python` and `pip`, installs as root.
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
    rm -f "$rootfs/usr/lib/python3.11/EXTERNALLY-MANAGED"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$rootfs_tar" .
    rm -rf "$rootfs"
fi
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
    "$rootfs_tar" python:3.11-slim >/dev/null
base_done=$(now)

# 2. A torch index on loopback: the CPU torch wheel of this machine and what it depends on.
index="$cache/torch-index"
if [ ! -d "$index" ]; then
    wheels="$cache/wheels"
    python3 -m pip download --quiet --only-binary :all: --dest "$wheels" "torch==2.13.0"
    for wheel in "$wheels"/*.whl; do
        project=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
        mkdir -p "$index/$project"
        ln -f "$wheel" "$index/$project/"
    done
fi
index_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$index" "$index_port" >/dev/null 2>&1 &
index_pid=$!

# 3. compose's Redis: Debian's redis-server on the base, behind an entrypoint that runs its arguments
# as the redis user, as the official image's docker-entrypoint.sh does.
export DOCKER_BUILDKIT=0
docker build --quiet --network host -t openjev-ci/compose-redis:7 - >/dev/null <<'DOCKERFILE'
FROM python:3.11-slim
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        redis-server util-linux >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data \
    && printf '#!/bin/sh\nexec setpriv --reuid=redis --regid=redis --init-groups "$@"\n' \
        > /usr/local/bin/docker-entrypoint.sh \
    && chmod 755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
DOCKERFILE
redis_done=$(now)

# 4. The project's images, under the names compose.yaml gives them.
docker build --quiet --network host -f deploy/Dockerfile -t openjev:0.1.0 . >/dev/null
api_done=$(now)
docker build --quiet --network host --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$index_port/" \
    -f deploy/Dockerfile.cpu-engine -t openjev-cpu-engine:0.1.0 . >/dev/null
engine_done=$(now)
echo "compose-images: base $(seconds "$started" "$base_done") s, redis $(seconds "$base_done" "$redis_done") s," \
    "openjev $(seconds "$redis_done" "$api_done") s, cpu engine $(seconds "$api_done" "$engine_done") s"
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}'
