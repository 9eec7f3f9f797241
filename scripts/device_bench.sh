#!/usr/bin/env bash
# Issue-6 measurements on one H200, in one device call: build, the CUDA kernel tests and
# micro-benchmarks, then `colossal bench` and the PyTorch + HF baseline
# (bench/baseline/hf_llama_baseline.py, a verbatim copy of shared/bench/hf_llama_baseline.py)
# side by side. Phases are picked by arguments, in order:
#   scripts/device_bench.sh build kernels graphs w1 w1base w1compile w2 w2base
# Logs and JSON go to $OUT; the last lines printed are a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
# The device tool returns at most 8 files: every log goes under $LOGS and comes back as one
# archive ($OUT/logs.tgz, written on exit, also when killed by a timeout) next to summary.txt.
# A second invocation in the same call (the same $OUT) writes logs2.tgz and summary2.txt, a third
# logs3.tgz and summary3.txt, so it does not overwrite the first one's.
N=""; while [ -e "$OUT/logs$N.tgz" ]; do N=$(( ${N:-1} + 1 )); done
LOGS=/tmp/cc_device_logs$N
rm -rf "$LOGS"; mkdir -p "$LOGS"
pack() { cp "$SUMMARY" "$OUT/summary$N.txt" 2>/dev/null; tar czf "$OUT/logs$N.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"; }
trap pack EXIT
# A TERM (the caller's timeout) stops the running benchmark too, so the logs still come back:
# every command below runs in the background and is waited for (bash runs traps during `wait`,
# never while a foreground child runs).
trap 'pkill -TERM -P $$ 2>/dev/null; exit 143' TERM INT
BUILD=${BUILD:-build-gpu}
C=$BUILD/colossal
PY=${COLOSSAL_PYTHON:-python3}
SUMMARY=$LOGS/summary.txt
: > "$SUMMARY"
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
note() { echo "$*" | tee -a "$SUMMARY"; }
ours() {  # ours NAME colossal-bench-args...
  local name=$1; shift
  timeout "${G13_TIMEOUT:-600}" $C bench --device cuda --json "$LOGS/$name.json" "$@" > "$LOGS/$name.log" 2>&1 &
  if wait $!; then
    note "ours $name: $($PY -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%.0f tok/s/GPU, %.1f TFLOPS, MFU %.3f, step %.4f s, peak %.1f GiB, loss %.4f" % (r["tokens_per_s_per_gpu"], r["model_tflops_per_gpu"], r["mfu_989"], r["median_step_s"], r["peak_memory_mib"] / 1024, r["final_loss"]))' "$LOGS/$name.json") | $*"
  else
    note "ours $name: FAILED ($*): $(grep -v '^\s*$' "$LOGS/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
  fi
}
base() {  # base NAME baseline-args... (NAME hf_peft_*: the PEFT LoRA baseline)
  local name=$1; shift
  local script=bench/baseline/hf_llama_baseline.py
  case $name in hf_peft_*) script=bench/baseline/hf_peft_lora_baseline.py ;; esac
  $PY $script "$@" > "$LOGS/$name.log" 2>&1 &
  if wait $!; then
    note "base $name: $(grep '^RESULT' "$LOGS/$name.log" | cut -c8-) | $*"
  else
    note "base $name: FAILED ($*): $(grep -v '^\s*$' "$LOGS/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
  fi
}
kernel_test() {  # kernel_test NAME: one of tests/kernels' GPU tests, its verdict in the summary
  local t=$1 to=300 filter=""
  [ $t = test_attention_cuda ] && to=150
  [ $t = test_model_cuda ] && [ -f "$LOGS/own_attention_failed" ] && filter="--gtest_filter=-*OwnAttention*"
  if timeout $to "$BUILD/tests/kernels/$t" $filter > "$LOGS/$t.log" 2>&1; then note "PASS $t: $(grep -E 'PASSED|SKIPPED' "$LOGS/$t.log" | tr '\n' ' ')"
  else
    note "FAIL $t (rc $?)"; grep -E -A6 "Failure" "$LOGS/$t.log" | head -60
    [ $t = test_attention_cuda ] && { touch "$LOGS/own_attention_failed"; tail -5 "$LOGS/$t.log"; }
  fi
}
# Ring attention's blocks on the GPU: ATen's flash kernels merged by log-sum-exp against fp64,
# and ring_attention end to end on one rank.
ring_test() {
  if timeout 300 "$BUILD/tests/nn/test_nn_ring_blocks" > "$LOGS/test_nn_ring_blocks.log" 2>&1; then
    note "PASS test_nn_ring_blocks: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_nn_ring_blocks.log" | head -2 | tr '\n' ' ')"
  else note "FAIL test_nn_ring_blocks"; grep -E -A6 "Failure|error" "$LOGS/test_nn_ring_blocks.log" | head -30; fi
  grep -E '^(own|flash|composite|ring_attention)|^  (out|dq|dk|dv) ' "$LOGS/test_nn_ring_blocks.log" | paste -sd' ' | cut -c1-1500
}
# overlap_step on the GPU at one rank: the side-stream and deferred updates equal the
# synchronous step bit for bit (fused kernels on and off), and the CPU cases.
step_overlap_test() {
  if timeout 300 "$C" run --nproc_per_node 1 --master_port 0 "$BUILD/tests/booster/test_step_overlap" \
       > "$LOGS/test_step_overlap.log" 2>&1; then
    note "PASS test_step_overlap: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_step_overlap.log" | head -2 | tr '\n' ' ')"
  else note "FAIL test_step_overlap"; grep -E -A6 "Failure|error" "$LOGS/test_step_overlap.log" | head -30; fi
}
# A packed build (scripts/device_pack.sh: one xz archive), unpacked once, in place.
unpack_build() {  # unpack_build DIR
  if [ -f "$1/binaries.tar.xz" ] && [ ! -x "$1/colossal" ]; then
    tar -C "$1" -xJf "$1/binaries.tar.xz" || note "$1/binaries.tar.xz does not unpack"
  fi
}
# With .carry/fp8text in `carry`, bench_kernels --op attention also packs the Python standard
# library's real document lengths (its document index).
DI=""; [ -f .carry/fp8text/stdlib.bin.docs ] && DI="--doc_index .carry/fp8text/stdlib.bin.docs"
for phase in "$@"; do
  case $phase in
  prebuilt)
    # Binaries built on the CI-class machine against the same torch 2.11.0+cu130 wheel
    # (scripts/device_pack.sh -> build-carry, passed in `carry`): point the loader at this
    # machine's torch and CUDA libraries; if they do not start here, fall through to a build.
    TL=$($PY -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
    NV=$(find "$(dirname "$TL")/.." /usr/local/cuda*/lib64 -maxdepth 4 -name 'libcudart.so.13*' 2>/dev/null | head -1)
    PB=${PREBUILT:-build-carry}  # another packed build (an A/B of two commits) by name
    unpack_build "$PB"
    # cuDNN from the nvidia-cudnn wheel next to torch (bench_kernels --op sdpa_fe links it).
    CD=$(find "$(dirname "$TL")/.." -maxdepth 4 -name 'libcudnn.so.9' 2>/dev/null | head -1)
    export LD_LIBRARY_PATH="$TL${NV:+:$(dirname "$NV")}${CD:+:$(dirname "$CD")}:$PWD/$PB/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if [ -x $PB/colossal ] && $PB/colossal check > "$LOGS/prebuilt_check.log" 2>&1; then
      BUILD=$PB; C=$BUILD/colossal
      note "prebuilt binaries start here: $(grep -i 'cuda kernels\|device 0' "$LOGS/prebuilt_check.log" | head -2 | tr '\n' ' ')"
      continue
    fi
    note "prebuilt binaries do not start here ($(tail -1 "$LOGS/prebuilt_check.log" 2>/dev/null)): building"
    ;&
  build)
    step build
    if ! TARGETS="colossal_cli test_kernels test_kernels_cuda test_attention_cuda test_model_cuda test_vocab_ce_cuda test_nn_ring_blocks test_gemini_1rank test_zero_1rank test_step_overlap test_pipeline_stages test_pipeline_executor bench_kernels" BUILD=$BUILD \
         scripts/device_build.sh -DCOLOSSAL_WERROR=OFF > "$LOGS/build.log" 2>&1; then
      tail -40 "$LOGS/build.log"; exit 1
    fi
    grep -c "warning" "$LOGS/build.log" | xargs echo "build warnings:"
    $C check 2>&1 | tail -5 ;;
  attntest)
    # Only our attention kernels' GPU test (a device call that re-checks a fix to them).
    step "attention kernel test"
    kernel_test test_attention_cuda ;;
  kernels|ktests)
    step kernel tests
    # Our attention kernels first run here: when their test fails or hangs (cut at 150 s; its log
    # shows how far the cases got), the model test skips OwnAttention and the attn / ownattn
    # phases leave our kernels out, so a hang costs one timeout, not several.
    for t in test_kernels test_kernels_cuda test_attention_cuda test_model_cuda test_vocab_ce_cuda; do
      kernel_test $t
    done
    # Gemini on the GPU (one rank under the launcher): half the chunks offloaded trains as ddp.
    if timeout 300 "$C" run --nproc_per_node 1 --master_port 0 "$BUILD/tests/zero/test_gemini_1rank" \
         --gtest_filter='GeminiCuda*' > "$LOGS/test_gemini_cuda.log" 2>&1; then
      note "PASS test_gemini_1rank GeminiCuda*: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_gemini_cuda.log" | head -2 | tr '\n' ' ')"
    else note "FAIL test_gemini_1rank GeminiCuda*"; grep -E -A6 "Failure|error" "$LOGS/test_gemini_cuda.log" | head -30; fi
    # ZeRO on the GPU at one rank: held gradients vs cpu_offload (norms on the device).
    if timeout 300 "$C" run --nproc_per_node 1 --master_port 0 "$BUILD/tests/zero/test_zero_1rank" \
         --gtest_filter='ZeroCuda*' > "$LOGS/test_zero_cuda.log" 2>&1; then
      note "PASS test_zero_1rank ZeroCuda*: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_zero_cuda.log" | head -2 | tr '\n' ' ')"
    else note "FAIL test_zero_1rank ZeroCuda*"; grep -E -A6 "Failure|error" "$LOGS/test_zero_cuda.log" | head -30; fi
    step_overlap_test
    ring_test
    # Pipeline chunks on the GPU: the deferred residual resolved at every chunk boundary.
    if timeout 300 "$BUILD/tests/pipeline/test_pipeline_stages" --gtest_filter='*Cuda' \
         > "$LOGS/test_pipeline_stages_cuda.log" 2>&1; then
      note "PASS test_pipeline_stages *Cuda: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_pipeline_stages_cuda.log" | head -2 | tr '\n' ' ')"
    else note "FAIL test_pipeline_stages *Cuda"; grep -E -A6 "Failure|error" "$LOGS/test_pipeline_stages_cuda.log" | head -30; fi
    # The pipeline interpreter on one rank: two chunks of a real model through the fused kernels.
    if timeout 300 "$C" run --nproc_per_node 1 --master_port 0 "$BUILD/tests/pipeline/test_pipeline_executor" \
         > "$LOGS/test_pipeline_executor_cuda.log" 2>&1; then
      note "PASS test_pipeline_executor (1 rank, cuda): $(grep -E 'PASSED|SKIPPED' "$LOGS/test_pipeline_executor_cuda.log" | head -2 | tr '\n' ' ')"
    else note "FAIL test_pipeline_executor (1 rank, cuda)"; grep -E -A6 "Failure|error" "$LOGS/test_pipeline_executor_cuda.log" | head -30; fi
    # Asynchronous saves: device snapshots hold the values of the moment of the save.
    if timeout 300 "$BUILD/tests/checkpoint/test_async_writer" > "$LOGS/test_async_writer.log" 2>&1; then
      note "PASS test_async_writer: $(grep -E 'PASSED|SKIPPED' "$LOGS/test_async_writer.log" | head -2 | tr '\n' ' ')"
    else note "FAIL test_async_writer"; grep -E -A6 "Failure|error" "$LOGS/test_async_writer.log" | head -30; fi
    [ "$phase" = ktests ] && continue
    step kernel micro-benchmarks
    timeout 400 "$BUILD/bench/bench_kernels" --json "$OUT/bench_kernels.json" > "$LOGS/bench_kernels.log" 2>&1
    echo "rc $?"; cat "$LOGS/bench_kernels.log" | tail -60 ;;
  w1)
    step "W1 ours: 1b seq 2048 batch 8 bf16"
    ours w1 -c 1b -p ddp -b 8 -l 2048 -s 15 -i 3
    ours w1_unfused -c 1b -p ddp -b 8 -l 2048 -s 15 -i 3 --fused_kernels false
    [ -n "${QUICK:-}" ] || ours w1_flash -c 1b -p ddp -b 8 -l 2048 -s 15 -i 3 --attn_backend flash ;;
  w1only)
    step "W1 ours only"
    ours w1 -c 1b -p ddp -b 8 -l 2048 -s 15 -i 3 ;;
  w1prof)
    step "W1 ours under the profiler (one extra untimed step, kernel table)"
    ours w1_prof -c 1b -p ddp -b 8 -l 2048 -s 6 -i 3 --profile --profile_dir "$LOGS/prof_w1"
    sed -n '/^profile of one step/,/Chrome trace/p' "$LOGS/w1_prof.log" | tee -a "$SUMMARY" ;;
  w2prof)
    step "W2 ours (bs1, no recompute) under the profiler"
    ours w2_prof -c 7b -p ddp -b 1 -l 4096 -s 5 -i 3 --profile --profile_dir "$LOGS/prof_w2"
    sed -n '/^profile of one step/,/Chrome trace/p' "$LOGS/w2_prof.log" | tee -a "$SUMMARY" ;;
  attn)
    # Issue 25, first step: cuDNN's SDPA graphs through the cuDNN frontend (bench_kernels built
    # with scripts/fetch_cudnn_frontend.sh's headers) next to LibTorch's SDPA backends, same call.
    step "attention: LibTorch SDPA backends and cuDNN frontend graphs"
    ops="${ATTN_OPS:-attention sdpa sdpa_fe}"
    [ -f "$LOGS/own_attention_failed" ] && ops="${ops//attention/}" && note "attn: our kernels failed their test; --op attention left out"
    for op in $ops; do
      timeout 300 "$BUILD/bench/bench_kernels" --op $op --reps 10 $DI > "$LOGS/bk_$op.log" 2>&1
      grep -E "^(sdpa|attention|ring_blocks)" "$LOGS/bk_$op.log" | tee -a "$SUMMARY"
      tail -2 "$LOGS/bk_$op.log"
    done ;;
  attnab)
    # Issue 25: our kernels' speed A/B in one call (bench_kernels --op attention): other packed
    # builds ($ATTNAB_OLD, one or more folders such as build-old from scripts/device_pack.sh of
    # an earlier commit, passed in `carry`; rows labelled by folder) and this one under each
    # COLOSSAL_ATTENTION_L2_MB of $ATTNAB_L2 (default "0 24": no head sections, the default).
    # $ATTNAB_BI adds this build under each COLOSSAL_ATTENTION_BWD_INTERLEAVE (percent or auto,
    # the backward's launch order; rows labelled bi_N; the l2_N rows run the default, auto) at
    # the default L2 budget.
    # The summary keeps the rows matching $ATTNAB_ROWS. ATTNAB_TEST=1 runs each other build's
    # test_attention_cuda first (a variant that is measured must be correct too).
    step "attention A/B: ${ATTNAB_OLD:+$ATTNAB_OLD, }this build at L2 budgets ${ATTNAB_L2:-0 24} MiB"
    if [ -f "$LOGS/own_attention_failed" ]; then note "attnab: skipped (our kernels failed their test)"; continue; fi
    # ATTNAB_REPS=n runs the whole set n times, the builds interleaved (A B A B ...: drift and
    # neighbours' noise fall on both sides), rows labelled with the round; ATTNAB_CASE passes
    # --attn_case (W1, W2 or W2-B4 alone).
    for d in ${ATTNAB_OLD:-}; do unpack_build "$d"; done
    for round in $(seq 1 "${ATTNAB_REPS:-1}"); do
      [ "$round" -gt 1 ] && ATTNAB_TEST=0
      for v in ${ATTNAB_OLD:-} $(for l in ${ATTNAB_L2:-0 24}; do echo "l2_$l"; done) \
               $(for i in ${ATTNAB_BI:-}; do echo "bi_$i"; done); do
        if [ -d "$v" ] && [ "${ATTNAB_TEST:-0}" = 1 ]; then
          if LD_LIBRARY_PATH="$PWD/$v/lib:$LD_LIBRARY_PATH" timeout 150 "$v/tests/kernels/test_attention_cuda" > "$LOGS/test_attention_cuda_$v.log" 2>&1
          then note "PASS $v test_attention_cuda: $(grep -E 'PASSED' "$LOGS/test_attention_cuda_$v.log" | tr '\n' ' ')"
          else note "FAIL $v test_attention_cuda"; grep -E -A6 "Failure" "$LOGS/test_attention_cuda_$v.log" | head -30; fi
        fi
        if [ -d "$v" ]; then
          LD_LIBRARY_PATH="$PWD/$v/lib:$LD_LIBRARY_PATH" timeout 300 "$v/bench/bench_kernels" --op attention --reps 10 ${ATTNAB_CASE:+--attn_case $ATTNAB_CASE} $DI > "$LOGS/bk_attn_${v}_$round.log" 2>&1 &
        elif [ "${v#bi_}" != "$v" ]; then
          COLOSSAL_ATTENTION_BWD_INTERLEAVE=${v#bi_} timeout 300 "$BUILD/bench/bench_kernels" --op attention --reps 10 ${ATTNAB_CASE:+--attn_case $ATTNAB_CASE} $DI > "$LOGS/bk_attn_${v}_$round.log" 2>&1 &
        else
          COLOSSAL_ATTENTION_L2_MB=${v#l2_} timeout 300 "$BUILD/bench/bench_kernels" --op attention --reps 10 ${ATTNAB_CASE:+--attn_case $ATTNAB_CASE} $DI > "$LOGS/bk_attn_${v}_$round.log" 2>&1 &
        fi
        wait $! || note "attnab $v: FAILED: $(tail -2 "$LOGS/bk_attn_${v}_$round.log" | tr '\n' ' ' | cut -c1-300)"
        lab=$v; [ "${ATTNAB_REPS:-1}" -gt 1 ] && lab="$v#$round"
        grep -E "^attention" "$LOGS/bk_attn_${v}_$round.log" | grep -E "${ATTNAB_ROWS:-pingpong|sdpa cudnn}" | sed "s/^attention/$lab/" | tee -a "$SUMMARY"
      done
    done
    # With rounds: each build's median and its ratio to ATTNAB_REF's (default this build's
    # l2_24 rows, else its first L2 budget's), and the rounds' spread.
    if [ "${ATTNAB_REPS:-1}" -gt 1 ]; then
      $PY scripts/attnab_medians.py "$SUMMARY" ${ATTNAB_REF:+--ref "$ATTNAB_REF"} > "$LOGS/attnab_medians.txt"
      tee -a "$SUMMARY" < "$LOGS/attnab_medians.txt"
    fi ;;
  attntrace)
    # Issue 25: an event trace of the forward's CTA 0 (a build with
    # docs/experiments/attention_fwd_trace.patch applied, e.g. PREBUILT=build-trace): each
    # schedule's kernel appends its sixth launch's trace; the summary gets
    # docs/experiments/attention_trace_report.py's shares.
    step "attention forward traces"
    for c in W1 W2; do
      rm -f "$LOGS/trace_$c.txt"
      COLOSSAL_ATTENTION_TRACE_FILE="$LOGS/trace_$c.txt" COLOSSAL_ATTENTION_TRACE_LAUNCH=5 \
        timeout 120 "$BUILD/bench/bench_kernels" --op attention --reps 10 --attn_case $c > "$LOGS/bk_trace_$c.log" 2>&1 ||
        note "attntrace $c: rc $? ($(tail -1 "$LOGS/bk_trace_$c.log" | cut -c1-200))"
      if [ -s "$LOGS/trace_$c.txt" ]; then
        $PY docs/experiments/attention_trace_report.py "$LOGS/trace_$c.txt" | tee -a "$SUMMARY"
      else
        note "attntrace $c: no trace (is the build from attention_fwd_trace.patch?)"
      fi
    done ;;
  attnprof)
    # Issue 25: Nsight Compute on our attention kernels (hardware counters: Firecracker machines
    # only, clocks left alone): one launch each of W1's and W2's backward and forward
    # (causal, the default schedule), and of cuDNN's backward kernel (`cudnn_bwd`, LibTorch's
    # cuDNN SDPA on the same inputs), the full section set. Back as text: the details page and
    # the SASS with its per-instruction stall samples (CSV).
    step "attention kernels under ncu"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { note "attnprof: no ncu here"; continue; }
    # ATTNPROF_ONLY: a regex on "case direction" (e.g. "fwd") picks some of them.
    while read -r c what re; do
      [[ "$c $what" =~ ${ATTNPROF_ONLY:-.} ]] || continue
      n="ncu_${c}_$what"
      timeout 240 "$NCU" --clock-control none --set full --import-source no --kernel-name-base mangled \
        -k "regex:$re" --launch-skip 3 --launch-count 1 -f -o "/tmp/$n" \
        "$BUILD/bench/bench_kernels" --op attention --reps 3 --attn_case "$c" > "$LOGS/$n.log" 2>&1 ||
        note "attnprof $c $what: rc $? ($(tail -1 "$LOGS/$n.log" | cut -c1-200))"
      "$NCU" -i "/tmp/$n.ncu-rep" --page details --print-details all > "$LOGS/${n}_details.txt" 2>&1
      "$NCU" -i "/tmp/$n.ncu-rep" --page source --print-source sass --csv > "$LOGS/${n}_sass.csv" 2>&1
      "$NCU" -i "/tmp/$n.ncu-rep" --page raw --csv > "$LOGS/${n}_raw.csv" 2>&1
      note "attnprof $c $what: $(grep -E '^ +(Duration|Compute \(SM\) Throughput|Memory Throughput)' "$LOGS/${n}_details.txt" | tr -s ' ' | tr '\n' ';' | cut -c1-300)"
    done <<'SPECS'
W1 bwd BwdTraitsILi64ELi[0-9]+ELb[01]EEELb1ELb0ELb1E
W2 bwd BwdTraitsILi128ELi[0-9]+ELb[01]EEELb1ELb0ELb1E
W2 fwd FwdTraitsILi128ELi128ELi[0-9]+EEELb1ELb1ELb1E
W1 fwd FwdTraitsILi64ELi128ELi[0-9]+EEELb1ELb1ELb1E
W2 cudnn_bwd sdpa_sm90_flash_bprop
W1 cudnn_bwd sdpa_sm90_flash_bprop
SPECS
    ;;
  attnkt)
    # Issue 25: each kernel's own GPU time in bench_kernels --op attention (Nsight Compute, one
    # metric, caches and clocks left alone), so a backward splits into its delta, main and
    # convert kernels, and cuDNN's rows into theirs. ATTNKT_CASES: the cases (default W1 W2).
    step "attention kernel times under ncu"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { note "attnkt: no ncu here"; continue; }
    for c in ${ATTNKT_CASES:-W1 W2}; do
      timeout 240 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --kernel-name-base demangled \
        --csv --print-units base --log-file "$LOGS/kt_$c.csv" \
        "$BUILD/bench/bench_kernels" --op attention --reps 3 --attn_case "$c" $DI > "$LOGS/kt_$c.log" 2>&1 ||
        note "attnkt $c: rc $? ($(tail -1 "$LOGS/kt_$c.log" | cut -c1-200))"
      note "attnkt $c:"
      $PY scripts/attn_kernel_times.py "$LOGS/kt_$c.csv" 2>&1 | tee -a "$SUMMARY"
    done ;;
  attnclk)
    # Issue 25: the SM clock, power and clock-event reasons sampled (nvidia-smi, every 20 ms)
    # while each attention row is timed, matched to the rows by bench_kernels --timing_log; then,
    # where nsys is installed, every kernel's duration in the same back-to-back run (what
    # attnkt's isolated Nsight Compute times cannot show). ATTNCLK_CASES (default W2-B4 W2),
    # ATTNCLK_REPS (default 30), ATTNCLK_ROWS (default the default schedule and cuDNN).
    step "attention rows under sustained load: clocks, power, in-run kernel times"
    NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems*/*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -1)
    # power.draw.instant where the driver has it (power.draw may average the last second, which
    # a row shorter than that inherits from the rows before it).
    Q=""
    for p in power.draw.instant power.draw; do
      for r in clocks_event_reasons.active clocks_throttle_reasons.active; do
        q=timestamp,clocks.sm,clocks.mem,$p,temperature.gpu,$r
        [ -z "$Q" ] && nvidia-smi --query-gpu=$q --format=csv,noheader,nounits -c 1 > /dev/null 2>&1 && Q=$q
      done
    done
    note "attnclk samples: ${Q:-none (nvidia-smi answers none of the queries)}"
    for c in ${ATTNCLK_CASES:-W2-B4 W2}; do
      TZ=UTC nvidia-smi --query-gpu=$Q --format=csv,noheader,nounits -lms 20 > "$LOGS/clk_$c.csv" 2>&1 &
      smi=$!
      rm -f "$LOGS/clk_$c.timing"
      timeout 300 "$BUILD/bench/bench_kernels" --op attention --attn_case "$c" --reps "${ATTNCLK_REPS:-30}" \
        --timing_log "$LOGS/clk_$c.timing" > "$LOGS/clk_$c.log" 2>&1 &
      wait $! || note "attnclk $c: rc $? ($(tail -1 "$LOGS/clk_$c.log" | cut -c1-200))"
      kill $smi 2>/dev/null; wait $smi 2>/dev/null
      note "attnclk $c ($(nvidia-smi --query-gpu=clocks.max.sm,power.limit --format=csv,noheader | head -1)):"
      $PY scripts/attn_clocks.py clocks "$LOGS/clk_$c.csv" "$LOGS/clk_$c.timing" "$LOGS/clk_$c.log" \
        --rows "${ATTNCLK_ROWS:-pingpong( |\+dq_tma)|sdpa cudnn}" 2>&1 | tee -a "$SUMMARY"
      if [ -n "$NSYS" ]; then
        timeout 300 "$NSYS" profile -t cuda -s none --cpuctxsw=none -f true -o "$LOGS/nsys_$c" \
          "$BUILD/bench/bench_kernels" --op attention --attn_case "$c" --reps "${ATTNCLK_REPS:-30}" > "$LOGS/nsys_$c.log" 2>&1 &&
        "$NSYS" stats -r cuda_gpu_trace -f csv -o "$LOGS/nsys_$c" "$LOGS/nsys_$c.nsys-rep" >> "$LOGS/nsys_$c.log" 2>&1 &&
        { note "attnclk $c, kernels in the run (nsys):"
          $PY scripts/attn_clocks.py nsys "$(ls "$LOGS"/nsys_"$c"*cuda_gpu_trace*.csv | head -1)" 2>&1 | tee -a "$SUMMARY"; } ||
        note "attnclk $c: nsys failed ($(tail -2 "$LOGS/nsys_$c.log" | tr '\n' ' ' | cut -c1-200))"
      else
        note "attnclk: no nsys here"
      fi
    done ;;
  fp8prof)
    # Issue 20: where the W2 step goes with FP8 linears, next to bf16 (kernel tables).
    # FP8PROF_WORKLOADS="w2 w1" profiles W1 (1b, seq 2048, batch 8) too.
    for w in ${FP8PROF_WORKLOADS:-w2}; do
      step "$w bf16 and FP8 under the profiler"
      shape="-c 7b -b 1 -l 4096"; [ $w = w1 ] && shape="-c 1b -b 8 -l 2048"
      for mode in bf16 fp8; do
        extra=""; [ $mode = fp8 ] && extra="--use_fp8 true --fp8_recipe ${FP8_RECIPE:-tensorwise}"
        ours ${w}_prof_$mode $shape -p ddp -s 5 -i 3 --profile --profile_dir "$LOGS/prof_${w}_$mode" $extra
        sed -n '/^profile of one step/,/Chrome trace/p' "$LOGS/${w}_prof_$mode.log" | tee -a "$SUMMARY"
      done
    done ;;
  graphs)
    step "CUDA graphs: forward + backward replayed (launch-bound small models vs W1)"
    for m in tiny 100m; do
      ours ${m}_eager -c $m -p none -b 8 -l 512 -s 30 -i 5
      ours ${m}_graph -c $m -p none -b 8 -l 512 -s 30 -i 5 --cuda_graph
    done
    ours w1_graph -c 1b -p none -b 8 -l 2048 -s 15 -i 3 --cuda_graph ;;
  ovtest) step_overlap_test ;;
  ringtest) ring_test ;;
  ovstep)
    # --overlap_step (the update on a side stream, each layer's forward waiting for its share)
    # against the synchronous step, same binary, in the order off on on off: W1, and W2 (7b)
    # or, where OVSTEP_W2 names a config (bench/configs/llama-7b-16l.json on an 80 GB card), that.
    step "overlap_step: W1 / W2, off vs on"
    for w in ${OVSTEP_WORKLOADS:-w1 w2}; do
      for mode in false true true false; do
        n=$(ls "$LOGS" | grep -c "^ovstep_${w}_${mode}" || true)
        if [ $w = w1 ]; then
          ours ovstep_${w}_${mode}$n -c 1b -p ddp -b 8 -l 2048 -s ${OVSTEP_W1_STEPS:-15} -i 3 --overlap_step $mode
        else
          ours ovstep_${w}_${mode}$n -c ${OVSTEP_W2:-7b} -p ddp -b 1 -l 4096 -s ${OVSTEP_W2_STEPS:-10} -i 2 --overlap_step $mode
        fi
      done
    done ;;
  ownattn)
    # Issue 25: the model with our attention kernels (--attn_backend own) against SDPA's choice,
    # side by side: W1 (1b, seq 2048, batch 8) and W2 (7b, seq 4096, batch 1; OWNATTN_W2=0
    # skips it on a card without its memory). The report's "attention kernels" line says which
    # kernel served the calls.
    # OWNATTN_SCHEDULE picks the kernels' schedule (COLOSSAL_ATTENTION_SCHEDULE: plain, overlap,
    # pingpong, each with an optional +dq_tma) for the own runs; unset, the kernels' default.
    if [ -f "$LOGS/own_attention_failed" ]; then note "ownattn: skipped (our kernels failed their test)"; continue; fi
    step "our attention in the model: W1 / W2, auto vs own (${OWNATTN_SCHEDULE:-default schedule})"
    export COLOSSAL_ATTENTION_SCHEDULE="${OWNATTN_SCHEDULE:-}"
    for mode in auto own own auto; do
      n=$(ls "$LOGS" | grep -c "^own_w1_${mode}" || true)
      ours own_w1_${mode}$n -c 1b -p ddp -b 8 -l 2048 -s 12 -i 3 --attn_backend $mode
      grep "attention kernels" "$LOGS/own_w1_${mode}$n.log" | tee -a "$SUMMARY"
    done
    if [ "${OWNATTN_W2:-1}" != 0 ]; then
      for mode in auto own own auto; do
        n=$(ls "$LOGS" | grep -c "^own_w2_${mode}" || true)
        ours own_w2_${mode}$n -c 7b -p ddp -b 1 -l 4096 -s 10 -i 3 --attn_backend $mode
      done
    fi
    unset COLOSSAL_ATTENTION_SCHEDULE ;;
  w1base)
    step "W1 baseline: eager amp and torch.compile"
    base w1_eager --model 1b --bs 8 --seq 2048 --mode amp ;;
  w1compile)
    step "W1 baseline: torch.compile"
    base w1_compile --model 1b --bs 8 --seq 2048 --mode amp --compile ;;
  w2)
    step "W2 ours: 7b seq 4096, fp32 AdamW states"
    ours w2_b1 -c 7b -p ddp -b 1 -l 4096 -s 12 -i 3
    ours w2_b2_attn -c 7b -p ddp -b 2 -l 4096 -s 12 -i 3 --ckpt_mode attention
    [ -n "${QUICK:-}" ] || ours w2_b2_l16 -c 7b -p ddp -b 2 -l 4096 -s 12 -i 3 -g --ckpt_layers 16
    ours w2_b4_full -c 7b -p ddp -b 4 -l 4096 -s 10 -i 2 -g ;;
  w2b1)
    step "W2 ours, bs1 only"
    ours w2_b1 -c 7b -p ddp -b 1 -l 4096 -s 12 -i 3 ;;
  w2base1)
    step "W2 baseline, bs1 only"
    base w2_b1 --model 7b --bs 1 --seq 4096 ;;
  w2base)
    step "W2 baseline: 7b bs1 and bs4 --ckpt"
    base w2_b1 --model 7b --bs 1 --seq 4096
    base w2_b4_ckpt --model 7b --bs 4 --seq 4096 --ckpt ;;
  gemini)
    step "Gemini on one GPU: 7b gemini 1/0/0 vs zero2; 13b gemini_auto"
    timeout 120 "$BUILD/bench/bench_kernels" --copies --reps 10 > "$LOGS/copies.log" 2>&1
    grep "host copy" "$LOGS/copies.log" | tee -a "$SUMMARY"
    ours g7_zero2 -c 7b -p zero2 -b 1 -l 4096 -s 6 -i 2
    ours g7_gemini -c 7b -p gemini -b 1 -l 4096 -s 6 -i 2
    ours g13_auto -c 13b -p gemini_auto -b 1 -l 4096 -s 4 -i 1 -g --profile --profile_dir "$LOGS/prof_g13"
    grep -i "memory report\|placement\|chunk size" "$LOGS/g13_auto.log" | head -8 | cut -c1-400 | tee -a "$SUMMARY"
    [ -f "$LOGS/prof_g13/rank0.json" ] && $PY scripts/trace_memcpy.py "$LOGS/prof_g13/rank0.json" | tee -a "$SUMMARY" ;;
  krows)
    step "row-op micro-benchmarks (RMSNorm, rotary, SwiGLU)"
    timeout 120 "$BUILD/bench/bench_kernels" --rows > "$LOGS/bench_rows.log" 2>&1
    grep -E "rms_norm|rotary|swiglu|ceiling|copy" "$LOGS/bench_rows.log" | head -30 | tee -a "$SUMMARY" ;;
  g7)
    # Issue 7's "gemini static 1/0/0 vs zero2 within 5 %", side by side.
    step "7b gemini 1/0/0 vs zero2"
    ours g7_zero2 -c 7b -p zero2 -b 1 -l 4096 -s 7 -i 2
    ours g7_gemini -c 7b -p gemini -b 1 -l 4096 -s 7 -i 2 ;;
  gov)
    # Gemini's CPU Adam beside the next forward vs inside step(), side by side: 1b with every
    # chunk's optimizer data and weights on the host (all of its Adam runs on the CPU).
    step "1b gemini 1/1/1: CPU Adam overlapped vs in step()"
    for ov in false true; do
      ours "gov_$ov" -c 1b -p gemini --offload_optim_frac 1 --offload_param_frac 1 -b 8 -l 2048 -s 7 -i 2 -g --overlap_cpu_adam $ov
    done ;;
  g13)
    # The 13b gemini_auto measurement alone (issue 7), with Gemini's chunk traffic from the trace.
    # Time it: at 13b the setup alone takes about 3 minutes (12:56Z run) and the first step,
    # which places the chunks and allocates 54 GB of pinned moments, about 45 s; give
    # G13_TIMEOUT 420 s or more.
    step "13b gemini_auto, profiled; pinned copies for reference"
    timeout 120 "$BUILD/bench/bench_kernels" --copies --reps 10 > "$LOGS/copies.log" 2>&1
    grep "host copy" "$LOGS/copies.log" | tee -a "$SUMMARY"
    for b13 in ${G13_BATCH:-8 4}; do  # the first batch that trains
      G13_TIMEOUT=${G13_TIMEOUT:-480} ours g13_auto -c 13b -p gemini_auto -b $b13 -l 4096 -s ${G13_STEPS:-4} -i 1 -g --profile --profile_dir "$LOGS/prof_g13"
      [ -s "$LOGS/g13_auto.json" ] && break
    done
    grep -i "memory report\|placement\|chunk size\|offload\|evict\|gemini" "$LOGS/g13_auto.log" | head -16 | cut -c1-400 | tee -a "$SUMMARY"
    tail -5 "$LOGS/g13_auto.log" | cut -c1-300 | tee -a "$SUMMARY"
    [ -f "$LOGS/prof_g13/rank0.json" ] && $PY scripts/trace_memcpy.py "$LOGS/prof_g13/rank0.json" | tee -a "$SUMMARY" ;;
  gmax)
    # "The largest Llama that trains on one H200": 13b scaled in depth (bench/configs), largest
    # first is not useful (a refusal is quick, a run is not): in the order given.
    step "13b scaled in depth, gemini_auto"
    for cfg in ${GMAX_CONFIGS:-llama-13b-44l llama-13b-48l}; do
      G13_TIMEOUT=${G13_TIMEOUT:-420} ours "gmax_$cfg" -c "bench/configs/$cfg.json" -p gemini_auto -b ${GMAX_BATCH:-8} -l 4096 -s ${G13_STEPS:-3} -i 1 -g
      grep -i "gemini\|placement\|memory report" "$LOGS/gmax_$cfg.log" | head -6 | cut -c1-400 | tee -a "$SUMMARY"
    done ;;
  ab)
    # Two packed builds side by side (issue 17: "no regression from the indirection"): W1 (1b,
    # seq 2048, batch 8) and W2 (7b, seq 4096, batch 1) in the order A B B A, so a drift of the
    # machine during the call cancels; each run's figure is the median of its timed steps.
    # AB_A / AB_B name the folders (default build-before / build-carry); AB_WORKLOADS may add g13
    # (13b gemini_auto, about 4 minutes a run) and AB_ORDER change the order (default A B B A).
    step "A/B: W1 and W2, ${AB_A:-build-before} vs ${AB_B:-build-carry}"
    for w in ${AB_WORKLOADS:-w1 w2}; do
      for side in ${AB_ORDER:-A B B A}; do
        dir=${AB_A:-build-before}; [ $side = B ] && dir=${AB_B:-build-carry}
        n=$(ls "$LOGS" | grep -c "^ab_${w}_${side}" || true)
        if [ $w = w1 ]; then
          C=$dir/colossal ours "ab_${w}_${side}$n" -c 1b -p ddp -b 8 -l 2048 -s ${AB_W1_STEPS:-15} -i 3
        elif [ $w = g13 ]; then  # 13b gemini_auto: 4 steps, the first (first use of pinned buffers) ignored
          C=$dir/colossal G13_TIMEOUT=${G13_TIMEOUT:-480} ours "ab_${w}_${side}$n" -c 13b -p gemini_auto -b 8 -l 4096 -s ${AB_G13_STEPS:-4} -i 1 -g
        else
          C=$dir/colossal ours "ab_${w}_${side}$n" -c 7b -p ddp -b 1 -l 4096 -s ${AB_W2_STEPS:-10} -i 2
        fi
      done
    done
    C=$BUILD/colossal ;;
  hybrid1)
    # Issue 18: "the abstraction costs nothing": -p 3d at tp 1 / sp 1 against -p ddp, one binary,
    # W1 and W2 in the order ddp 3d 3d ddp (a drift of the machine during the call cancels).
    step "hybrid at tp 1 vs ddp: W1 and W2"
    for w in ${H1_WORKLOADS:-w1 w2}; do
      for p in ddp 3d 3d ddp; do
        n=$(ls "$LOGS" | grep -c "^h1_${w}_${p}" || true)
        extra=""; [ $p = 3d ] && extra="--tp 1 --sp 1 --pp 1 --zero 0"
        if [ $w = w1 ]; then
          ours "h1_${w}_${p}$n" -c 1b -p $p $extra -b 8 -l 2048 -s ${AB_W1_STEPS:-15} -i 3
        else
          ours "h1_${w}_${p}$n" -c 7b -p $p $extra -b 1 -l 4096 -s ${AB_W2_STEPS:-10} -i 2
        fi
      done
    done ;;
  lora)
    # Issue 21: LoRA on the 7b shape (bf16 base, r 16, alpha 32 on all seven projections, seq 4096,
    # batch 1) by `colossal train` (ddp, one GPU, random tokens) against HF + PEFT
    # (bench/baseline/hf_peft_lora_baseline.py) in the same call; LORA_FULL=1 adds the peak-memory
    # comparison: LoRA and full fine-tuning of the same shape, both with every layer recomputed
    # (--grad_checkpoint; full fine-tuning's 112 GB of weights, gradients and AdamW states would
    # not leave room for stored activations).
    step "LoRA 7b: ours vs HF PEFT"
    TOK=/tmp/lora_tokens.bin
    $PY -c "import numpy as np; np.random.default_rng(0).integers(0, 32000, size=600_000, dtype=np.uint16).tofile('$TOK')"
    T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
    for mode in lora ${LORA_FULL:+lora_ck full_ck}; do
      extra="--lora_r 16 --lora_alpha 32 --lora_targets $T7"; [ $mode = full_ck ] && extra=""
      case $mode in *_ck) extra="$extra --grad_checkpoint true" ;; esac
      timeout 500 $C train --device cuda --model 7b --precision bf16 --plugin ddp --data $TOK \
        --seq_len 4096 --micro_batch 1 --steps ${LORA_STEPS:-15} --lr 1e-4 --warmup 2 --log_every 5 \
        --metrics_file "$LOGS/lora_$mode.jsonl" $extra > "$LOGS/lora_$mode.log" 2>&1 &
      wait $!; rc=$?
      $PY - "$LOGS/lora_$mode.jsonl" $mode $rc <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
try:
    by = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
except OSError:
    by = {}
if not by:
    print("ours lora7b %s rc %s: no metrics" % (sys.argv[2], sys.argv[3])); sys.exit()
last = max(by)
dt = sorted(by[s]["elapsed_s"] - by[s - 1]["elapsed_s"] for s in by if s > 3 and s - 1 in by)
med = dt[len(dt) // 2]
print("ours lora7b %-5s rc %s: %d steps, median step %.4f s = %.0f tok/s, peak device %.1f GiB, loss %.4f -> %.4f"
      % (sys.argv[2], sys.argv[3], last, med, 4096 / med, max(r.get("device_peak_allocated_bytes", 0) for r in by.values()) / 2**30,
         by[1]["loss"], by[last]["loss"]))
PYEOF
      tail -3 "$LOGS/lora_$mode.log"
    done
    base hf_peft_lora7b --model 7b --bs 1 --seq 4096 --r 16 --alpha 32 ;;
  fp8)
    # Issue 20: FP8 linear layers (--use_fp8) against our bf16, side by side in one call, in the
    # order bf16 fp8 fp8 bf16 (drift cancels): W2 (7b, seq 4096, batch 1) and W1 (1b, seq 2048,
    # batch 8) with the tensorwise recipe, then W2 rowwise once; the cast, FP8-GEMM and NF4
    # micro-benchmarks of bench_kernels.
    step "FP8: cast / GEMM kernels"
    for op in fp8_cast fp8_gemm nf4_dequant; do
      timeout 120 "$BUILD/bench/bench_kernels" --op $op --reps 20 > "$LOGS/bk_$op.log" 2>&1
      grep -E "^$op" "$LOGS/bk_$op.log" | tee -a "$SUMMARY"
    done
    step "FP8: W2 / W1 bf16 vs fp8"
    # FP8_WORKLOADS: unset, both; "" none (so FP8_G13's pair has the call to itself).
    for w in ${FP8_WORKLOADS-w2 w1}; do
      for mode in bf16 fp8 fp8 bf16; do
        n=$(ls "$LOGS" | grep -c "^fp8_${w}_${mode}" || true)
        extra=""; [ $mode = fp8 ] && extra="--use_fp8 true --fp8_recipe tensorwise"
        if [ $w = w2 ]; then ours "fp8_${w}_${mode}$n" -c 7b -p ddp -b 1 -l 4096 -s ${FP8_STEPS:-10} -i 3 $extra
        else ours "fp8_${w}_${mode}$n" -c 1b -p ddp -b 8 -l 2048 -s ${FP8_STEPS:-12} -i 3 $extra; fi
      done
    done
    case " ${FP8_WORKLOADS-w2 w1} " in  # rowwise once, with W2
      *" w2 "*) [ "${FP8_ROWWISE:-1}" = 0 ] || ours fp8_w2_rowwise -c 7b -p ddp -b 1 -l 4096 -s ${FP8_STEPS:-10} -i 3 --use_fp8 true --fp8_recipe rowwise ;;
    esac
    # FP8_G13=1: 13b gemini_auto bf16 vs FP8, both in one call: each run takes about 4 minutes
    # (setup ~2 min, the first step and the move to the measured placement ~70 s, then
    # G13_STEPS timed steps of 7-10 s; docs/benchmarks.md, issue 7), so with FP8_WORKLOADS=""
    # the pair fits one 600 s call at the default G13_TIMEOUT of 285 s each.
    if [ -n "${FP8_G13:-}" ]; then
      for mode in bf16 fp8; do
        extra=""; [ $mode = fp8 ] && extra="--use_fp8 true"
        G13_TIMEOUT=${G13_TIMEOUT:-285} ours "fp8_g13_$mode" -c 13b -p gemini_auto -b 8 -l 4096 -s ${G13_STEPS:-3} -i 1 -g $extra
      done
    fi ;;
  fp8loss)
    # Issue 20: FP8 (tensorwise) and bf16 loss curves from the same init and data on real text:
    # a ~110M Llama (vocabulary 16384) on the Python standard library's source, tokenized on the
    # CPU machine by scripts/make_real_text.py into .carry/fp8text (pass it in `carry`), 600
    # steps of 4 x 1024 tokens (one pass over 3.08M tokens, nothing repeated), lr 6e-4 cosine,
    # warmup 50. The summary gives the largest relative gap after warm-up; the plot comes back
    # as $OUT/fp8_loss.svg.
    step "FP8 vs bf16 loss on real text"
    D=${FP8TEXT:-.carry/fp8text}
    for mode in bf16 fp8; do
      extra=""; [ $mode = fp8 ] && extra="--use_fp8 true --fp8_recipe ${FP8_RECIPE:-tensorwise}"
      timeout ${FP8LOSS_TIMEOUT:-280} $C train --device cuda --model $D/model.json --data $D/stdlib.bin \
        --seq_len 1024 --micro_batch 4 --steps ${FP8LOSS_STEPS:-600} --lr 6e-4 --schedule cosine \
        --warmup 50 --precision bf16 --plugin none --seed 1 --log_every 50 \
        --metrics_file "$LOGS/fp8loss_$mode.jsonl" $extra > "$LOGS/fp8loss_$mode.log" 2>&1 &
      wait $!; note "fp8loss $mode rc $?: $(tail -1 "$LOGS/fp8loss_$mode.log" | cut -c1-200)"
    done
    $PY scripts/plot_curves.py "$LOGS/fp8loss_bf16.jsonl" "$LOGS/fp8loss_fp8.jsonl" --labels bf16,fp8 \
      --after 50 --title "110M Llama on Python stdlib source: bf16 vs FP8 (${FP8_RECIPE:-tensorwise})" \
      --out "$OUT/fp8_loss.svg" 2>&1 | tee -a "$SUMMARY" ;;
  qlora)
    # Issue 21: QLoRA on one H200. The 70b shape with its linear layers stored in NF4 (double
    # quantisation) on the GPU, quantized as each weight is initialised (`--quantize nf4`), LoRA
    # r 16 / alpha 32 on all seven projections, bf16, seq 4096, batch 1, every decoder layer
    # recomputed (`--grad_checkpoint`); then the 7b shape the same way next to its bf16-base LoRA
    # run (phase lora). Reports tok/s (median step), peak device memory (metrics file) and the
    # process's peak host RSS (getrusage of the child).
    step "QLoRA: 70b nf4 (and 7b nf4) by colossal train"
    TOK=/tmp/qlora_tokens.bin
    $PY -c "import numpy as np; np.random.default_rng(0).integers(0, 32000, size=600_000, dtype=np.uint16).tofile('$TOK')"
    T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
    for shape in ${QLORA_SHAPES:-70b 7b}; do
      ck=""; [ $shape = 70b ] && ck="--grad_checkpoint true"
      timeout ${QLORA_TIMEOUT:-520} $PY -c "
import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print('peak host RSS %.1f GiB' % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20), file=sys.stderr)
sys.exit(rc)" $C train --device cuda --model $shape --precision bf16 --plugin none --quantize nf4 $ck \
        --data $TOK --seq_len 4096 --micro_batch 1 --steps ${QLORA_STEPS:-6} --lr 1e-4 --warmup 1 \
        --log_every 1 --lora_r 16 --lora_alpha 32 --lora_targets $T7 \
        --metrics_file "$LOGS/qlora_$shape.jsonl" > "$LOGS/qlora_$shape.log" 2>&1 &
      wait $!; rc=$?
      $PY - "$LOGS/qlora_$shape.jsonl" $shape $rc "$(grep -h 'peak host RSS' "$LOGS/qlora_$shape.log")" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
try:
    by = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
except OSError:
    by = {}
if not by:
    print("ours qlora %s rc %s: no metrics; %s" % (sys.argv[2], sys.argv[3], sys.argv[4])); sys.exit()
last = max(by)
dt = sorted(by[s]["elapsed_s"] - by[s - 1]["elapsed_s"] for s in by if s > 2 and s - 1 in by)
med = dt[len(dt) // 2] if dt else float("nan")
print("ours qlora %-4s rc %s: %d steps, median step %.3f s = %.0f tok/s, peak device %.1f GiB, %s, loss %.4f -> %.4f"
      % (sys.argv[2], sys.argv[3], last, med, 4096 / med, max(r.get("device_peak_allocated_bytes", 0) for r in by.values()) / 2**30,
         sys.argv[4], by[1]["loss"], by[last]["loss"]))
PYEOF
      grep -h "quantized to\|LoRA:" "$LOGS/qlora_$shape.log" | head -3
      tail -3 "$LOGS/qlora_$shape.log"
    done ;;
  docmask)
    # Issue 22: packed documents on the GPU. W1's shape (1b, seq 2048, batch 8, bf16, ddp) by
    # `colossal train` on random tokens cut into documents of 32..1024 tokens (a mask on 70 %):
    # plain, with the loss mask, and with --doc_mask (variable-length flash attention); tok/s
    # over steps 6..N from each metrics file, the three runs back to back.
    step "doc_mask: W1 train plain / mask / doc_mask"
    TOK=/tmp/dm_tokens.bin
    $PY - $TOK <<'PYEOF'
import numpy as np, sys
rng = np.random.default_rng(0)
n = 3_000_000
t = rng.integers(0, 32000, size=n).astype(np.uint16)
h = np.zeros(256, np.int32); h[0], h[1], h[2] = 20240520, 1, n
open(sys.argv[1], "wb").write(h.tobytes() + t.tobytes())
lens = rng.integers(32, 1025, size=n // 32)
off = np.concatenate([[0], np.cumsum(lens)]); off = off[off < n]; off = np.append(off, n)
h = np.zeros(256, np.int32); h[0], h[1], h[2] = 20241204, 1, len(off) - 1
open(sys.argv[1] + ".docs", "wb").write(h.tobytes() + off.astype(np.uint64).tobytes())
PYEOF
    N=${DM_STEPS:-40}
    for mode in plain mask docmask; do
      rm -f $TOK.mask; extra=""
      if [ $mode != plain ]; then
        $PY -c "import numpy as np; n=3_000_000; h=np.zeros(256,np.int32); h[0],h[1],h[2]=20241205,1,n; m=(np.random.default_rng(1).random(n)<0.7).astype(np.uint8); open('$TOK.mask','wb').write(h.tobytes()+m.tobytes())"
      fi
      [ $mode = docmask ] && extra="--doc_mask true"
      timeout 600 $C train --device cuda --model 1b --precision bf16 --plugin ddp --data $TOK \
        --seq_len 2048 --micro_batch 8 --steps $N --lr 1e-4 --warmup 5 --log_every 10 \
        --metrics_file "$LOGS/dm_$mode.jsonl" $extra > "$LOGS/dm_$mode.log" 2>&1 &
      wait $!; rc=$?
      $PY - "$LOGS/dm_$mode.jsonl" $mode $rc <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
by = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
last = max(by)
dt = sorted(by[s]["elapsed_s"] - by[s - 1]["elapsed_s"] for s in by if s > 5 and s - 1 in by)
med = dt[len(dt) // 2]
print("dm_w1 %-8s rc %s: %d steps, median step %.4f s = %.0f tok/s, loss %.4f -> %.4f"
      % (sys.argv[2], sys.argv[3], last, med, 8 * 2048 / med, by[1]["loss"], by[last]["loss"]))
PYEOF
    done ;;
  ckpt)
    # Issue 23: checkpoints with bounded memory and asynchronous writes. CKPT_PARTS picks:
    #   w1    W1 (1b, seq 2048, batch 8) `colossal train` for CKPT_STEPS steps: no saves, async
    #         saves every 50 steps with --keep_last 2, synchronous saves the same way (tok/s over
    #         steps 11..N from the metrics file; the final save is after the loop, timed apart);
    #   disk  the largest model whose checkpoint fits the disk (2.7b, ~38 GB) saved and loaded
    #         back by `colossal bench --checkpoint_test DIR` (seconds, peak memory);
    #   z7    7b zero2 and g13 13b gemini_auto saves into the discarding sink (peak device and
    #   g13   host memory against training's, seconds).
    step "checkpoints: ${CKPT_PARTS:-w1 disk z7 g13}"
    df -h /tmp . | tee -a "$SUMMARY"
    ckpt_note() {  # the checkpoint figures of a bench JSON
      $PY -c 'import json,sys; c=json.load(open(sys.argv[1]))["checkpoint"]; print(sys.argv[2], " ".join("%s=%.3g" % (k, v) for k, v in c.items() if k != "where"))' "$LOGS/$1.json" "$1" | tee -a "$SUMMARY"
    }
    for part in ${CKPT_PARTS:-w1 disk z7 g13}; do
      case $part in
      w1)
        TOK=/tmp/ck_tokens.bin
        $PY -c "import numpy as np; np.random.default_rng(0).integers(0, 32000, size=4_000_000, dtype=np.uint16).tofile('$TOK')"
        N=${CKPT_STEPS:-160}
        # CKPT_MODES: none, async or sync, each with an optional @<save_every> (default 50).
        for mode in ${CKPT_MODES:-none async sync}; do
          every=${mode#*@}; [ "$every" = "$mode" ] && every=50
          mode=${mode%@*}_$every; [ "${mode%_*}" = none ] && mode=none
          rm -rf /tmp/ck_$mode
          extra=""
          [ $mode != none ] && extra="--save_dir /tmp/ck_$mode --save_every $every --keep_last ${CKPT_KEEP:-2}"
          [ "${mode%_*}" = async ] && extra="$extra --async_save"
          s0=$(date +%s.%N)
          timeout 600 $C train --device cuda --model 1b --precision bf16 --plugin ddp --data $TOK \
            --seq_len 2048 --micro_batch 8 --steps $N --lr 1e-4 --warmup 10 --log_every 50 \
            --metrics_file "$LOGS/ck_w1_$mode.jsonl" $extra > "$LOGS/ck_w1_$mode.log" 2>&1 &
          wait $!; rc=$?
          s1=$(date +%s.%N)
          $PY - "$LOGS/ck_w1_$mode.jsonl" $mode $rc $s0 $s1 <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {r["step"]: r for r in rows}
last = max(by)
tok = (by[last]["tokens"] - by[10]["tokens"]) / (by[last]["elapsed_s"] - by[10]["elapsed_s"])
print("ck_w1 %-5s rc %s: %d steps, %.0f tok/s over steps 11..%d, loop %.1f s, process %.1f s, final loss %.4f"
      % (sys.argv[2], sys.argv[3], last, tok, last, by[last]["elapsed_s"], float(sys.argv[5]) - float(sys.argv[4]), by[last]["loss"]))
steps = sorted(s for s in by if s - 1 in by and s > 10)
dt = {s: by[s]["elapsed_s"] - by[s - 1]["elapsed_s"] for s in steps}
med = sorted(dt.values())[len(dt) // 2]
print("  median step %.4f s; slow steps: %s" % (med, " ".join("%d:%.2fs" % (s, dt[s]) for s in steps if dt[s] > 1.5 * med)))
PYEOF
          grep -i "saved checkpoint\|keep_last\|error\|stage up to" "$LOGS/ck_w1_$mode.log" | tail -6 | cut -c1-300 | tee -a "$SUMMARY"
          ls /tmp/ck_$mode 2>/dev/null | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
          du -sh /tmp/ck_$mode 2>/dev/null | tee -a "$SUMMARY"
          rm -rf /tmp/ck_$mode
        done
        rm -f $TOK ;;
      disk)
        rm -rf /tmp/ck_disk
        ours ck_disk_2p7b -c bench/configs/llama-2.7b.json -p ddp -b 4 -l 4096 -s 4 -i 2 -g --checkpoint_test /tmp/ck_disk
        ckpt_note ck_disk_2p7b
        du -sh /tmp/ck_disk | tee -a "$SUMMARY"
        rm -rf /tmp/ck_disk ;;
      z7)
        ours ck_z7 -c 7b -p zero2 -b 1 -l 4096 -s 4 -i 2 --checkpoint_test discard
        ckpt_note ck_z7 ;;
      g13)
        G13_TIMEOUT=${G13_TIMEOUT:-540} ours ck_g13 -c 13b -p gemini_auto -b ${G13_BATCH:-4} -l 4096 -s 3 -i 1 -g --checkpoint_test discard
        ckpt_note ck_g13 ;;
      esac
    done ;;
  *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
step summary
cat "$SUMMARY"
