#!/usr/bin/env bash
# Variants of the one-rank cuda dispatch kernel (MOERL_EP_SOLO_* knobs, src/ep/cuda/cuda_engine.cpp) on
# the GPU at hand: one `moerl bench ep` run per variant, one line each with the dispatch time of the
# DeepSeek-V3-shaped case (4096 tokens, hidden 7168, top-8, 256 experts, bf16) against a device copy of
# the same bytes timed in the same run, and the 128-token case; then the phase times of a few variants.
#
#   scripts/ep_solo_sweep.sh build/moerl [tokens]
set -euo pipefail

moerl=${1:?usage: $0 path/to/moerl [tokens]}
tokens=${2:-4096}
sms=${MOERL_SWEEP_SMS:-132}

# name, then the knobs it sets (on top of the defaults)
variants=(
    "default|"
    "warps_per_row=1|MOERL_EP_SOLO_WARPS_PER_ROW=1"
    "prefetch=0|MOERL_EP_SOLO_PREFETCH=0"
    "prefetch=32|MOERL_EP_SOLO_PREFETCH=32"
    "blocks=264|MOERL_EP_SOLO_BLOCKS=264"
    "blocks=396|MOERL_EP_SOLO_BLOCKS=396"
    "warps_per_row=2|MOERL_EP_SOLO_WARPS_PER_ROW=2"
    "unroll=8|MOERL_EP_SOLO_UNROLL=8"
    "prefetch=8|MOERL_EP_SOLO_PREFETCH=8"
    "cache=2|MOERL_EP_SOLO_CACHE=2"
    "cache=3|MOERL_EP_SOLO_CACHE=3"
    "lookback_ns=0|MOERL_EP_SOLO_LOOKBACK_NS=0"
    "lookback_ns=2000|MOERL_EP_SOLO_LOOKBACK_NS=2000"
    "synchronous|MOERL_EP_CUDA_ASYNC=0"
)

start=$SECONDS
printf '%-16s | %12s | %8s | %12s | %7s | %15s | %10s\n' variant "dispatch us" "GB/s" "copy us" "of copy" "128-tok disp us" \
    "combine us"
for v in "${variants[@]}"; do
    name=${v%%|*}
    read -ra knobs <<<"${v#*|}"
    # Every variant times its own device copy in the same iterations (same clocks, same host jitter).
    flags=(--transport cuda --ranks 1 --sms "$sms" --tokens "$tokens" --iters 50)
    # table rows: | transport | W | case | disp | tok/r | hidden | K | E | rows/r | dispatch us | GB/s
    # | combine us | GB/s | from peers | baseline us | GB/s | LL |
    out=$(env MOERL_EP_CUDA_ASYNC=1 "${knobs[@]}" timeout 30 "$moerl" bench ep "${flags[@]}" 2>&1) || {
        printf '%-16s | failed: %s\n' "$name" "$(tail -n 1 <<<"$out")"
        continue
    }
    big=$(awk -F'|' '$4 ~ /dsv3/ {gsub(/ /, ""); print $11, $12, $13, $16}' <<<"$out")
    small=$(awk -F'|' '$4 ~ /decode/ {gsub(/ /, ""); print $11}' <<<"$out")
    if [[ -z $big ]]; then
        printf '%-16s | no result: %s\n' "$name" "$(tail -n 1 <<<"$out")"
        continue
    fi
    read -r d_us d_gbps c_us copy_us <<<"$big"
    pct=$(awk -v d="$d_us" -v c="$copy_us" 'BEGIN { printf "%.1f%%", (d > 0 ? 100 * c / d : 0) }')
    printf '%-16s | %12s | %8s | %12s | %7s | %15s | %10s\n' "$name" "$d_us" "$d_gbps" "$copy_us" "$pct" "$small" "$c_us"
done
# Where the time goes: the kernel's phases per tile (MOERL_EP_SOLO_TRACE), last call of each case
# (128 tokens, then $tokens), for the default and the variants named in MOERL_SWEEP_TRACE.
read -ra traced <<<"${MOERL_SWEEP_TRACE:-default prefetch=0 unroll=8}"
for v in "${variants[@]}"; do
    name=${v%%|*}
    [[ " ${traced[*]} " == *" $name "* ]] || continue
    read -ra knobs <<<"${v#*|}"
    echo "phases of $name (MOERL_EP_SOLO_TRACE=1):"
    env MOERL_EP_CUDA_ASYNC=1 "${knobs[@]}" MOERL_EP_SOLO_TRACE=1 timeout 30 "$moerl" bench ep --transport cuda \
        --ranks 1 --sms "$sms" --tokens "$tokens" --iters 3 --no-baseline 2>&1 | grep "one-rank dispatch" |
        awk '{ line[$4] = $0 } END { for (k in line) print line[k] }'
done
echo "($((SECONDS - start)) s)" >&2
