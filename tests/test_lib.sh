# Sourced by the shell tests: a scratch directory and failure bookkeeping.
#   new_tmp NAME       $tmp := a fresh /tmp/moerl-NAME.XXXXXX; failed := 0
#   fail MESSAGE       marks the test failed, saying MESSAGE on stderr
#   keep_or_remove_tmp on failure prints the tail of $tmp/*.log and keeps $tmp, else removes it
new_tmp() {
    test_name=$1
    tmp=$(mktemp -d "/tmp/moerl-$1.XXXXXX")
    failed=0
}
fail() {
    echo "$test_name test: FAIL: $*" >&2
    failed=1
}
keep_or_remove_tmp() {
    if ((failed)); then
        echo "---- logs (kept in $tmp) ----" >&2
        tail -n 20 "$tmp"/*.log "$tmp"/*.err >&2 2>/dev/null
    else
        rm -rf "$tmp"
    fi
}
