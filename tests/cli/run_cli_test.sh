#!/usr/bin/env bash
# `moerl run` as a user meets it: bad command lines and configs are errors naming what was wrong,
# one run per output directory, Ctrl-C says where the run stopped and exits 130, the progress line
# fits the terminal, and a resume says which checkpoint it continues from.
#   tests/cli/run_cli_test.sh PATH/TO/moerl
set -uo pipefail
moerl=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
export OPENBLAS_NUM_THREADS=1
source "$here/../test_lib.sh"
new_tmp run-cli
cd "$tmp" || exit 1  # a run on defaults writes runs/ here
cleanup() {
    [[ -n ${bg:-} ]] && kill -9 "$bg" 2>/dev/null
    mountpoint -q "$tmp/tiny" 2>/dev/null && umount "$tmp/tiny"
    keep_or_remove_tmp
}
trap cleanup EXIT

# The chaos tests' small run, long and with a checkpoint every 2 steps.
sed 's/name: chaos, seed: 7, steps: 90, checkpoint_every: 0/name: cli, seed: 7, steps: 100000, checkpoint_every: 2/' \
    "$here/../chaos/chaos.yaml" >"$tmp/run.yaml"
grep -q "steps: 100000, checkpoint_every: 2" "$tmp/run.yaml" || { echo "cannot adapt chaos.yaml" >&2; exit 1; }

# expect_error NAME STATUS TEXT -- COMMAND...: COMMAND exits with STATUS and its stderr holds TEXT.
expect_error() {
    local name=$1 status=$2 text=$3
    shift 4
    "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
    local rc=$?
    ((rc == status)) || fail "$name: exit status $rc; expected $status"
    grep -qF -- "$text" "$tmp/$name.err" || fail "$name: stderr lacks '$text': $(tail -n 2 "$tmp/$name.err")"
}

expect_error bogus 2 "moerl commands: " -- "$moerl" bogus
grep -q "run" "$tmp/bogus.err" || fail "bogus: the command list lacks run"
mkdir "$tmp/confdir"
expect_error dir 1 "config file $tmp/confdir is a directory" -- "$moerl" run "$tmp/confdir"
: >"$tmp/empty.yaml"
expect_error empty 1 "$tmp/empty.yaml:1: the config file is empty" -- "$moerl" run "$tmp/empty.yaml"
printf 'run: {name: a}\ntrain: {lr: 0.1}\nrun: {name: b}\n' >"$tmp/dup.yaml"
expect_error dup 1 "dup.yaml:3: run: duplicate key (first given on line 1)" -- "$moerl" run "$tmp/dup.yaml"
head -c 3000000 /dev/zero | tr '\0' '#' >"$tmp/big.yaml"
expect_error big 1 "3000000 bytes; a config is at most 1048576 bytes" -- "$moerl" run "$tmp/big.yaml"
printf 'run: {name: ../../etc/x}\n' >"$tmp/name.yaml"
expect_error name 1 "run.name: '../../etc/x' has the character '/'" -- "$moerl" run "$tmp/name.yaml"
expect_error redis 1 "--redis and --store need --distributed" -- \
    "$moerl" run "$tmp/run.yaml" --redis redis://127.0.0.1:1 --out "$tmp/r"
expect_error noresume 1 "--resume: no earlier run in $tmp/none" -- "$moerl" run "$tmp/run.yaml" --resume --out "$tmp/none"
[[ -e $tmp/none ]] && fail "--resume with no earlier run created $tmp/none"
"$moerl" --help | grep -q "128+N stopped by signal N" || fail "moerl --help does not document the exit status"

# One run per output directory; Ctrl-C says where it stopped.
"$moerl" run "$tmp/run.yaml" --out "$tmp/dup" >"$tmp/first.out" 2>"$tmp/first.err" &
bg=$!
for _ in $(seq 600); do grep -q "step 5/" "$tmp/first.err" && break; sleep 0.1; done
grep -q "step 5/" "$tmp/first.err" || fail "the first run did not train 5 steps"
expect_error second 1 "is in use by another moerl process (pid $bg," -- "$moerl" run "$tmp/run.yaml" --out "$tmp/dup"
kill -INT "$bg"
wait "$bg"
rc=$?
bg=
((rc == 130)) || fail "a run stopped by SIGINT exited with $rc; expected 130"
grep -q "stopped by SIGINT after step [0-9]*/100000; the newest checkpoint is at step [0-9]*, so [01] steps\? will be trained again" \
    "$tmp/first.out" || fail "SIGINT summary: $(cat "$tmp/first.out")"
grep -q -- "--resume" "$tmp/first.out" || fail "the SIGINT summary does not say how to continue"
grep -q "ETA" "$tmp/first.err" || fail "the progress line has no ETA"

# Resumed, it names the checkpoint; on a terminal of 60 columns no progress line is longer.
steps=$(grep -o "after step [0-9]*" "$tmp/first.out" | grep -o "[0-9]*$")
COLUMNS=60 script -qec "stty cols 60 2>/dev/null; '$moerl' run '$tmp/run.yaml' --out '$tmp/dup' --resume --steps $((steps + 4))" \
    /dev/null >"$tmp/resume.tty" 2>&1
grep -q "resumed at step [0-9]*/[0-9]* from checkpoint ckpt-[0-9]* in file://" "$tmp/resume.tty" ||
    fail "the resume does not name its checkpoint: $(head -c 300 "$tmp/resume.tty")"
grep -q "finished all $((steps + 4)) steps" "$tmp/resume.tty" || fail "the resumed run's summary: $(tail -c 300 "$tmp/resume.tty")"
longest=$(tr '\r' '\n' <"$tmp/resume.tty" | grep "^\[cli\] step [0-9]*/" | sed 's/\x1b\[K//g' | awk '{ if (length($0) > m) m = length($0) } END { print m + 0 }')
((longest > 0 && longest < 60)) || fail "progress lines on a 60-column terminal are up to $longest characters"

# A full disk leaves no staging or half-copied files: the run's output on a 1200 KiB tmpfs, where
# one can be mounted (root); skipped elsewhere.
mkdir "$tmp/tiny"
if mount -t tmpfs -o size=1200k tmpfs "$tmp/tiny" 2>/dev/null; then
    expect_error full 1 "cannot " -- "$moerl" run "$tmp/run.yaml" --out "$tmp/tiny/out" --steps 40 --quiet
    left=$(find "$tmp/tiny" -name '*.tmp.*' -o -path '*/staging/*' | head -n 3)
    [[ -z $left ]] || fail "a full disk left partial files behind: $left"
    umount "$tmp/tiny"
else
    echo "run-cli: the full-disk check is skipped (cannot mount a tmpfs here)"
fi

if ((failed)); then
    echo "run-cli test: FAILED"
    exit 1
fi
echo "run-cli test: PASSED"
