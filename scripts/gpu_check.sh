#!/usr/bin/env bash
# The first thing to run on a machine with a GPU. Every step's timeout is cut to what is left of
# GPU_CHECK_BUDGET seconds (450), so it ends within 8 minutes. Ends with one table:
# step | PASS/FAIL/SKIP | detail.
#
#   build   build the CUDA kernels (setup.py build_ext --inplace, MEGAZERO_BUILD_CUDA=1), then
#           `python -m megazero.ops` says which ops are built
#   tests   tests/test_ops_cuda.py: nvcc compile checks, the CUDA kernels against the references
#   smoke   5 fp32 iterations of a tiny GPT-2, its log parsed as the runs below are
#   train   50 bf16 iterations on one GPU of the README's GPT-2 and of GPT-2 345M: tokens/s and
#           MFU (scripts/gpu_check_report.py; PEAK_TFLOPS overrides the GPU's peak)
#   bench   benchmarks/bench_gpu_step.py in what is left of the budget (up to 300 s): GPT-2 345M
#           and 1.3B, megazero (eager, --compile) against the plain GPT-2 (torch.compile) and
#           Megatron-core, interleaved; JSON in $GPU_CHECK_DIR/bench_gpu_step.json, the row
#           gives megazero's tokens/s and MFU at both sizes and the fastest peer
#           (scripts/gpu_check_report.py bench)
#   parity  with 2+ GPUs: the lm loss of tp2, pp2, dp2 (and tp2 x pp2 x dp2 on 8 GPUs) under
#           NCCL against one GPU, 20 fp32 iterations, dropout off, within 1e-4 relative
#   vscpu   on one GPU: plain fp32, ZeRO-3, ZeRO-3 with states and parameters on NVMe, ZeRO-2
#           with a CPU-offloaded optimizer, and a checkpoint at 10 resumed to 20, each against
#           the same run on this host's CPU (CUDA_VISIBLE_DEVICES=), within 1e-4 relative
#
# Without a GPU the GPU steps are SKIP, with the reason, and the rest runs. Exit status 1 when a
# step FAILed. Logs go to $GPU_CHECK_DIR (/tmp/megazero_gpu_check). Knobs: PYTHON (python3),
# GPU_CHECK_STEPS (a subset of the names above), GPU_CHECK_QUICK=1 (no nvcc compile checks, a
# 3-iteration smoke run), GPU_CHECK_PARITY_ON_CPU=N (parity and vscpu on gloo as if N GPUs
# were there, to check this script on CPU), GPU_CHECK_BENCH_ON_CPU=1 (bench's CPU smoke run
# instead: tiny shapes, two contenders), GPU_CHECK_LAYOUTS (a subset of: tp2 pp2 dp2
# tp2xpp2xdp2). The whole list does not leave bench its 300 s within 450: on a lent GPU run
# GPU_CHECK_STEPS="build bench" (or raise GPU_CHECK_BUDGET).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-/tmp/megazero_gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-450}
QUICK=${GPU_CHECK_QUICK:-0}
WANTED=" ${GPU_CHECK_STEPS:-build tests smoke train bench parity vscpu} "
WANTED_LAYOUTS=" ${GPU_CHECK_LAYOUTS:-tp2 pp2 dp2 tp2xpp2xdp2} "
mkdir -p "$DIR" && rm -f "$DIR"/{build,ops_report,test_ops_cuda,smoke,train_*,parity_*,vscpu_*}.log
rm -rf "$DIR"/bench_gpu_step{,.json,.log}

COMMON_ARGS=(--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1
    --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --split 969,30,1 --eval-iters 0 --log-interval 10)
GPT2_TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --log-interval 1)
GPT2_SMALL=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
    --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16)  # the README's
GPT2_345M=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
    --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 16 --lr 3e-4
    --min-lr 3e-5)
# tests/test_scripts.py's CLI parity flags, on the default corpus instead of --mock-data (on
# random tokens the loss stays at ln V; here it falls from 8.3 to 7.3, so a wrong update shows)
PARITY_ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 20
    --lr 3e-3 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --attention-dropout 0
    --hidden-dropout 0 --clip-grad 1.0 --split 969,30,1)
LAYOUTS=("tp2 2 --tensor-model-parallel-size 2" "pp2 2 --pipeline-model-parallel-size 2" "dp2 2"
    "tp2xpp2xdp2 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")

# one GPU against this host's CPU: name and flags (NVME: a folder under $DIR)
VSCPU=("fp32" "zero3 --zero-stage 3"
    "zero3-nvme --zero-stage 3 --offload-optimizer nvme --offload-param nvme --nvme-path NVME"
    "zero2-cpu-offload --zero-stage 2 --offload-optimizer cpu" "resume")

STEPS=() STATUS=() DETAIL=()
record() {  # record STEP STATUS DETAIL
    STEPS+=("$1") STATUS+=("$2") DETAIL+=("$3")
    printf '[gpu_check] %-24s %-4s %s\n' "$1" "$2" "$3"
}

run_logged() {  # run_logged NAME CAP CMD...: CMD under min(CAP, budget left) s, into NAME.log
    local name=$1 cap=$2 left=$((BUDGET - SECONDS))
    shift 2
    ((left < cap)) && cap=$left
    ((cap >= 10)) || { echo "GPU_CHECK_BUDGET (${BUDGET}s) spent" >"$DIR/$name.log"; return 124; }
    timeout --kill-after=10 "$cap" "$@" >"$DIR/$name.log" 2>&1
}

failure() {  # failure RC NAME: why the command of NAME.log failed
    local last
    last=$(grep -v '^\s*$' "$DIR/$2.log" | tail -n 1 | cut -c1-160)
    last=${last:-no output}
    if (($1 == 124 || $1 == 137)); then echo "timed out: $last"; else echo "exit $1: $last"; fi
}

report_row() {  # report_row STEP ARGS...: the row gpu_check_report.py prints
    local step=$1 out
    shift
    out=$("$PYTHON" scripts/gpu_check_report.py "$@" 2>&1 | tail -n 1)
    case ${out%%$'\t'*} in
        PASS | FAIL | SKIP) record "$step" "${out%%$'\t'*}" "${out#*$'\t'}" ;;
        *) record "$step" FAIL "gpu_check_report.py: $out" ;;
    esac
}

flag() {  # flag NAME ARGS...: the value of the last NAME in ARGS
    local want=$1 value=""
    shift
    while (($# > 1)); do [[ $1 == "$want" ]] && value=$2; shift; done
    echo "$value"
}

step_build() {
    local ops report='from megazero.ops.__main__ import collect, print_report
info = collect(); print_report(info); cuda = [o for o in info["ops"] if o["name"][:5] == "cuda_"]
why = sorted({o["reason"].split(";")[0] for o in cuda if not o["built"]})[:1]
print("CUDA ops built: %d/%d" % (sum(o["built"] for o in cuda), len(cuda)), *why)'
    if ((NGPU > 0)); then
        run_logged build 300 env MEGAZERO_BUILD_CUDA=1 "$PYTHON" setup.py build_ext --inplace ||
            { record "build CUDA kernels" FAIL "$(failure $? build)"; return; }
    fi
    run_logged ops_report 60 "$PYTHON" -c "$report" ||
        { record "build CUDA kernels" FAIL "$(failure $? ops_report)"; return; }
    ops=$(grep '^CUDA ops built' "$DIR/ops_report.log" | cut -c1-120)
    if ((NGPU == 0)); then
        record "build CUDA kernels" SKIP "no GPU visible to torch; $ops"
    elif [[ $ops =~ built:\ ([0-9]+)/([0-9]+) ]] && ((BASH_REMATCH[1] == BASH_REMATCH[2])) &&
        ((BASH_REMATCH[2] > 0)); then
        record "build CUDA kernels" PASS "$ops ($GPU_NAME)"
    else  # setup.py reports a failed extension build and goes on: show why
        record "build CUDA kernels" FAIL "$ops; $(grep -m 1 -E 'megazero: (WARNING|CUDA kernels)' \
            "$DIR/build.log" | cut -c1-160)"
    fi
}

step_tests() {
    local args=(-m pytest -p no:cacheprovider -rs tests/test_ops_cuda.py) rc summary
    ((QUICK)) && args+=(-k "not compile")
    run_logged test_ops_cuda 240 "$PYTHON" "${args[@]}"
    rc=$?
    summary=$(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' \
        "$DIR/test_ops_cuda.log" | tail -n 1 | tr -d '=' | xargs)
    ((QUICK)) && summary+=" (GPU_CHECK_QUICK: no nvcc checks)"
    if ((rc != 0)); then
        record test_ops_cuda.py FAIL "${summary:-$(failure $rc test_ops_cuda)}"
    elif ((NGPU == 0)); then
        record test_ops_cuda.py SKIP "no GPU: CPU parts only, $summary"
    elif grep -q "SKIPPED.*needs a GPU" "$DIR/test_ops_cuda.log"; then
        record test_ops_cuda.py FAIL "GPU tests skipped (extension not built): $summary"
    else
        record test_ops_cuda.py PASS "$summary"
    fi
}

step_train() {  # step_train STEP NAME ITERS MODEL_ARRAY [REPORT_FLAGS...] [-- PRETRAIN_FLAGS...]
    local step=$1 name=$2 iters=$3 report=() extra=()
    local -n model=$4
    shift 4
    while (($#)) && [[ $1 != -- ]]; do report+=("$1"); shift; done
    (($#)) && shift && extra=("$@")
    local args=("${COMMON_ARGS[@]}" "${model[@]}" --train-iters "$iters" "${extra[@]}")
    run_logged "$name" 180 "$PYTHON" pretrain_gpt2.py "${args[@]}" ||
        { record "$step" FAIL "$(failure $? "$name")"; return; }
    report_row "$step" throughput "$DIR/$name.log" --expect-iters "$iters" \
        --num-layers "$(flag --num-layers "${args[@]}")" --device-name "$GPU_NAME" \
        --hidden-size "$(flag --hidden-size "${args[@]}")" \
        --seq-length "$(flag --seq-length "${args[@]}")" "${report[@]}"
}

step_bench() {  # bench_gpu_step.py within what is left (at most 300 s), its JSON's row
    local on_cpu=${GPU_CHECK_BENCH_ON_CPU:-0} left=$((BUDGET - SECONDS)) cap=300 args
    if ((NGPU == 0 && !on_cpu)); then record "bench GPU step" SKIP "no GPU"; return; fi
    ((left < cap)) && cap=$left
    # the benchmark's own budget stops starting jobs in time to write its JSON
    args=(--json "$DIR/bench_gpu_step.json" --budget-s $((cap - 20)))
    ((NGPU == 0)) && args+=(--device cpu --tiny --contenders megazero:eager,plain-gpt2:eager
        --models gpt2-345m --warmup 1 --iters 2 --rounds 1)
    if ((cap < 60)); then
        record "bench GPU step" SKIP "GPU_CHECK_BUDGET (${BUDGET}s) spent: ${left}s left"
        return
    fi
    run_logged bench_gpu_step "$cap" "$PYTHON" benchmarks/bench_gpu_step.py "${args[@]}" ||
        { record "bench GPU step" FAIL "$(failure $? bench_gpu_step)"; return; }
    report_row "bench GPU step" bench "$DIR/bench_gpu_step.json"
}

step_parity() {
    local slots=${GPU_CHECK_PARITY_ON_CPU:-$NGPU} spec layout n flags port
    if ((slots >= 2)); then
        run_logged parity_1gpu 120 "$PYTHON" pretrain_gpt2.py "${PARITY_ARGS[@]}" ||
            { record "parity: 1-GPU run" FAIL "$(failure $? parity_1gpu)"; return; }
    fi
    for spec in "${LAYOUTS[@]}"; do
        read -r layout n flags <<<"$spec"
        [[ $WANTED_LAYOUTS == *" $layout "* ]] || continue
        if ((slots < n)); then
            record "parity $layout" SKIP "needs $n GPUs, found $NGPU"
            continue
        fi
        port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0))
print(s.getsockname()[1])')
        # shellcheck disable=SC2086  # $flags: several words
        run_logged "parity_$layout" 180 "$PYTHON" -m torch.distributed.run --nproc-per-node "$n" \
            --master-port "$port" pretrain_gpt2.py "${PARITY_ARGS[@]}" $flags ||
            { record "parity $layout" FAIL "$(failure $? "parity_$layout")"; continue; }
        report_row "parity $layout" parity "$DIR/parity_1gpu.log" "$DIR/parity_$layout.log"
    done
}

step_vscpu() {
    local slots=${GPU_CHECK_PARITY_ON_CPU:-$NGPU} spec name flags log
    if ((slots < 1)); then record "GPU vs CPU" SKIP "no GPU"; return; fi
    run_logged vscpu_reference 180 env CUDA_VISIBLE_DEVICES= "$PYTHON" pretrain_gpt2.py \
        "${PARITY_ARGS[@]}" || { record "GPU vs CPU" FAIL "$(failure $? vscpu_reference)"; return; }
    for spec in "${VSCPU[@]}"; do
        read -r name flags <<<"$spec"
        log=vscpu_$name
        if [[ $name == resume ]]; then  # a checkpoint at 10, then 11-20 from it
            rm -rf "$DIR/vscpu_ckpt"
            run_logged "${log}_first" 120 "$PYTHON" pretrain_gpt2.py "${PARITY_ARGS[@]}" \
                --save "$DIR/vscpu_ckpt" --save-interval 10 --exit-interval 10 ||
                { record "GPU vs CPU: $name" FAIL "$(failure $? "${log}_first")"; continue; }
            run_logged "${log}_second" 120 "$PYTHON" pretrain_gpt2.py "${PARITY_ARGS[@]}" \
                --load "$DIR/vscpu_ckpt" ||
                { record "GPU vs CPU: $name" FAIL "$(failure $? "${log}_second")"; continue; }
            cat "$DIR/${log}_first.log" "$DIR/${log}_second.log" >"$DIR/$log.log"
        else
            # shellcheck disable=SC2086  # $flags: several words
            run_logged "$log" 120 "$PYTHON" pretrain_gpt2.py "${PARITY_ARGS[@]}" \
                ${flags//NVME/$DIR/vscpu_nvme} ||
                { record "GPU vs CPU: $name" FAIL "$(failure $? "$log")"; continue; }
        fi
        report_row "GPU vs CPU: $name" parity "$DIR/vscpu_reference.log" "$DIR/$log.log"
    done
}

IFS='|' read -r NGPU GPU_NAME TORCH <<<"$("$PYTHON" -c 'import torch
n = torch.cuda.device_count(); name = torch.cuda.get_device_name(0) if n else "cpu"
print(n, name, f"{torch.__version__} (CUDA {torch.version.cuda})", sep="|")' 2>/dev/null)"
[[ ${NGPU:-} =~ ^[0-9]+$ ]] || { NGPU=0 GPU_NAME=cpu TORCH="not importable by $PYTHON"; }
echo "[gpu_check] $NGPU GPU(s) ($GPU_NAME), torch $TORCH; logs in $DIR; budget ${BUDGET}s"

[[ $WANTED == *" build "* ]] && step_build
[[ $WANTED == *" tests "* ]] && step_tests
[[ $WANTED == *" smoke "* ]] && step_train "smoke train (tiny, fp32)" smoke $((QUICK ? 3 : 5)) \
    GPT2_TINY
if [[ $WANTED == *" train "* ]]; then
    for config in GPT2_SMALL GPT2_345M; do
        step=$([[ $config == GPT2_SMALL ]] && echo "gpt2 (README)" || echo "gpt2-345m")
        step="train $step bf16"
        if ((NGPU == 0)); then record "$step" SKIP "no GPU"; continue; fi
        step_train "$step" "train_${config,,}" 50 "$config" --require-loss-drop -- --bf16
    done
fi
[[ $WANTED == *" bench "* ]] && step_bench
[[ $WANTED == *" parity "* ]] && step_parity
[[ $WANTED == *" vscpu "* ]] && step_vscpu

width=4
for s in "${STEPS[@]}"; do ((${#s} > width)) && width=${#s}; done
printf '\n%-*s | %-6s | %s\n%s\n' "$width" step status detail "$(printf '%*s' 96 '' | tr ' ' -)"
for i in "${!STEPS[@]}"; do
    printf '%-*s | %-6s | %s\n' "$width" "${STEPS[i]}" "${STATUS[i]}" "${DETAIL[i]}"
done
echo "gpu_check: ${SECONDS}s, logs in $DIR"
for s in "${STATUS[@]}"; do [[ $s == FAIL ]] && exit 1; done
exit 0
