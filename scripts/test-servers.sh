#!/usr/bin/env bash
# Starts (or stops) the servers of the `dist` tests on loopback: redis-server and s3rver.
#
#   eval "$(scripts/test-servers.sh start DIR)"   # prints export lines; state and logs go to DIR
#   ctest --test-dir build -L dist
#   scripts/test-servers.sh stop DIR
#
# Ports are chosen free at start. The addresses are also written to DIR/env.sh.
# s3rver comes from ./node_modules/.bin/s3rver (npm install at the repository root).
set -euo pipefail

usage() {
    echo "usage: $0 start|stop DIR" >&2
    exit 2
}
[[ $# -eq 2 ]] || usage
action=$1
dir=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bucket=${MOERL_TEST_S3_BUCKET:-moerl-test}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# wait_for NAME SECONDS COMMAND...: retries COMMAND until it succeeds.
wait_for() {
    local name=$1 seconds=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "test-servers: $name did not answer within ${seconds}s (logs in $dir)" >&2
            return 1
        fi
        sleep 0.2
    done
}

stop_pidfile() {
    local pidfile=$1
    [[ -f $pidfile ]] || return 0
    local pid
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

start() {
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    command -v redis-server >/dev/null || { echo "test-servers: redis-server not found (apt-get install redis-server)" >&2; exit 1; }
    local s3rver=$root/node_modules/.bin/s3rver
    [[ -x $s3rver ]] || { echo "test-servers: $s3rver not found (run: npm install, at $root)" >&2; exit 1; }

    local redis_port s3_port
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
        --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --dir "$dir" >/dev/null
    wait_for redis-server 20 redis-cli -h 127.0.0.1 -p "$redis_port" ping

    s3_port=$(free_port)
    mkdir -p "$dir/s3"
    # s3rver's ListObjectsV2 continuation tokens use DES, which Node >= 17 has only in OpenSSL's legacy provider.
    NODE_OPTIONS=--openssl-legacy-provider nohup "$s3rver" --directory "$dir/s3" --address 127.0.0.1 --port "$s3_port" --silent \
        --configure-bucket "$bucket" >"$dir/s3rver.log" 2>&1 &
    echo $! >"$dir/s3rver.pid"
    wait_for s3rver 30 curl -sf -o /dev/null "http://127.0.0.1:$s3_port/"

    cat >"$dir/env.sh" <<EOF
export MOERL_TEST_REDIS_URL=redis://127.0.0.1:$redis_port/0
export MOERL_TEST_S3_ENDPOINT=http://127.0.0.1:$s3_port
export MOERL_TEST_S3_BUCKET=$bucket
export AWS_ACCESS_KEY_ID=S3RVER
export AWS_SECRET_ACCESS_KEY=S3RVER
export AWS_REGION=us-east-1
EOF
    cat "$dir/env.sh"
}

stop() {
    [[ -d $dir ]] || return 0
    if [[ -f $dir/redis.pid ]]; then
        stop_pidfile "$dir/redis.pid"
    fi
    stop_pidfile "$dir/s3rver.pid"
    rm -rf "$dir/s3" "$dir/env.sh"
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
