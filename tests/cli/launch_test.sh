#!/usr/bin/env bash
# moerl launch: torchrun's environment, TCPStore rendezvous for EP, and fail-fast when a rank dies.
set -u
moerl=$1
fail() { echo "FAIL: $*"; exit 1; }

# Every rank sees its own RANK and the shared WORLD_SIZE / MASTER_PORT.
out=$("$moerl" launch -n 3 -- sh -c 'echo "rank=$RANK/$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE port=$MASTER_PORT"' | sort)
[ "$(echo "$out" | grep -c 'rank=')" -eq 3 ] || fail "expected 3 ranks, got: $out"
for r in 0 1 2; do echo "$out" | grep -q "rank=$r/3 local=$r/3" || fail "rank $r missing: $out"; done
[ "$(echo "$out" | sed 's/.*port=//' | sort -u | wc -l)" -eq 1 ] || fail "ranks disagree on MASTER_PORT"

# EP over the launcher's TCPStore, on each host-memory transport built in.
for t in host fabric/tcp; do
  if "$moerl" launch -n 3 -- "$moerl" ep check --transport "$t" --timeout 20 >check.log 2>&1; then
    [ "$(grep -c 'rounds ok' check.log)" -eq 3 ] || fail "$t: not every rank reported ok: $(cat check.log)"
  elif grep -q "unknown EP transport" check.log; then
    echo "skip $t (not built)"
  else
    fail "$t: ep check failed: $(cat check.log)"
  fi
done

# One rank dies: the launcher stops the others (which would sleep for a minute) and exits non-zero.
start=$(date +%s)
"$moerl" launch -n 3 --grace 2 -- sh -c 'if [ "$RANK" = 1 ]; then exit 7; fi; sleep 60' && fail "launch returned 0"
code=$?
[ "$code" -eq 7 ] || fail "expected exit status 7 from the failed rank, got $code"
[ $(( $(date +%s) - start )) -lt 20 ] || fail "the other ranks were not stopped"
echo "launch tests: ok"
