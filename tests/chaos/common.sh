# Sourced by the chaos tests with their arguments (MOERL_BINARY CHAOS_DIR): skips without a test
# Redis, sets $moerl and $cfg (CHAOS_DIR/chaos.yaml) and pins the BLAS threads.
if [[ -z ${MOERL_TEST_REDIS_URL:-} ]]; then
    echo "skip: MOERL_TEST_REDIS_URL is not set (eval \"\$(scripts/test-servers.sh start DIR)\")"
    exit 0
fi
[[ $# -eq 2 ]] || { echo "usage: $0 MOERL_BINARY CHAOS_DIR" >&2; exit 2; }
moerl=$(realpath "$1")
cfg=$(realpath "$2/chaos.yaml")
export OPENBLAS_NUM_THREADS=1
