#!/usr/bin/env bash
# Builds the moerl image with podman or docker and smoke-runs it.
#
#   deploy/build-image.sh [--tag moerl:0.1.0] [--file deploy/Containerfile] [--ccache DIR]
#                         [--debootstrap] [--no-smoke]
#
# --debootstrap  makes the Debian 12 base image locally with debootstrap (for machines that reach
#                a Debian mirror but no container registry) and builds both stages from it.
# --ccache DIR   mounts DIR as the build's compiler cache (podman only: docker build has no -v).
# Prints the seconds each phase took. Exits 3 when no container engine works here, so a test can
# tell "cannot build here" from "the build failed".
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=$(sed -n 's/^project(moerl VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
tag="moerl:${version:-0.1.0}"
file=deploy/Containerfile
ccache_dir=""
debootstrap=0
smoke=1
while (($#)); do
    case $1 in
        --tag) tag=$2; shift 2 ;;
        --file) file=$2; shift 2 ;;
        --ccache) ccache_dir=$2; shift 2 ;;
        --debootstrap) debootstrap=1; shift ;;
        --no-smoke) smoke=0; shift ;;
        *) echo "build-image: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
cd "$root"
work=${MOERL_IMAGE_WORK:-/tmp/moerl-image-$(id -u)}
mkdir -p "$work"

# --- the engine ---------------------------------------------------------------------------------
engine=""
run_flags=()
if command -v podman >/dev/null; then
    # Also for machines without systemd (containers in containers): runc, cgroupfs, and ulimits
    # no higher than this shell's, since podman's defaults would raise them and runc fails there;
    # nproc is kept at 16384 at most (higher values were refused even below the hard limit).
    nproc_hard=$(ulimit -Hu)
    [[ $nproc_hard == unlimited ]] && nproc_hard=65536
    nproc=$((nproc_hard / 2 < 16384 ? nproc_hard / 2 : 16384))
    nofile=$(ulimit -Hn)
    [[ $nofile == unlimited ]] && nofile=65536
    cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "$(command -v runc >/dev/null && echo runc || echo crun)"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$work/containers.conf}
    if podman info >/dev/null 2>&1; then
        engine=podman
        run_flags=(--network host)
    fi
fi
if [[ -z $engine ]] && command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
fi
if [[ -z $engine ]]; then
    echo "build-image: no working container engine (podman or docker) here" >&2
    exit 3
fi
echo "build-image: engine $engine ($($engine --version | head -1))"

build_args=()
if ((debootstrap)); then
    base=localhost/moerl-base:bookworm
    if ! $engine image exists "$base" 2>/dev/null && ! $engine image inspect "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { echo "build-image: --debootstrap needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
        start=$SECONDS
        rm -rf "$work/rootfs"
        debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
            { tail -20 "$work/debootstrap.log"; exit 1; }
        # The security updates, as the registry's debian:bookworm has them.
        echo "deb http://deb.debian.org/debian-security bookworm-security main" >"$work/rootfs/etc/apt/sources.list.d/security.list"
        tar -C "$work/rootfs" -c . | $engine import - "$base" >/dev/null
        rm -rf "$work/rootfs"
        echo "build-image: base $base made by debootstrap in $((SECONDS - start)) s"
    fi
    build_args+=(--build-arg "BUILD_BASE=$base" --build-arg "RUNTIME_BASE=$base")
fi
if [[ -n $ccache_dir ]]; then
    [[ $engine == podman ]] || { echo "build-image: --ccache needs podman (docker build cannot mount a volume)" >&2; exit 2; }
    mkdir -p "$ccache_dir"
    build_args+=(-v "$(cd "$ccache_dir" && pwd):/ccache")
fi

start=$SECONDS
# pipefail: the pipeline fails with the build (the step filter alone never fails it).
if ! $engine build "${run_flags[@]}" "${build_args[@]}" -f "$file" -t "$tag" . 2>&1 | tee "$work/build.log" |
    { grep -E '^(STEP|\[[0-9]|#[0-9]+ \[)' || true; }; then
    tail -30 "$work/build.log"
    echo "build-image: build failed (log: $work/build.log)" >&2
    exit 1
fi
echo "build-image: $tag built in $((SECONDS - start)) s"
$engine image inspect "$tag" --format '{{.Size}}' 2>/dev/null | awk '{printf "build-image: image size %.0f MB\n", $1 / 1e6}' || true

((smoke)) || exit 0
# The entrypoint, as a non-root user with a read-only root filesystem (as the manifests run it).
ro=(--read-only --tmpfs /tmp --tmpfs /var/lib/moerl --cap-drop ALL --security-opt no-new-privileges)
user=$($engine run --rm "${run_flags[@]}" "${ro[@]}" --entrypoint /usr/bin/id "$tag" -u)
[[ $user == 10001 ]] || { echo "build-image: the image runs as uid $user; expected 10001" >&2; exit 1; }
$engine run --rm "${run_flags[@]}" "${ro[@]}" "$tag" --help >/dev/null
for role in env rollout reward train; do
    # No Redis on port 1: each role must start, parse the config and fail naming the address.
    out=$($engine run --rm "${run_flags[@]}" "${ro[@]}" "$tag" worker --role "$role" \
        --redis 'redis://127.0.0.1:1/0?retry_ms=0' --store file:///var/lib/moerl/store --run-id smoke \
        /usr/share/moerl/examples/quickstart.yaml 2>&1 || true)
    grep -q "127.0.0.1:1" <<<"$out" || { echo "build-image: role $role: unexpected output:"; echo "$out"; exit 1; }
done
echo "build-image: smoke run ok (uid 10001, read-only root, roles env rollout reward train start)"
