#!/usr/bin/env bash
# The GPU measurements the suite's open work needs, part by part, most valuable first. Each command runs under its own
# time limit (SIGINT, then SIGKILL 20 s later: gpu_check.py and the fits keep what they finished, and the benchmarks
# write the rows they finished, their table saying where they were cut) and writes its table to $OUT as soon as it
# ends, and session.log says when each started, how it ended (exit status, seconds) and where its output is, so a short
# lease returns what finished and names what did not.
#
#   bash benchmarks/gpu_session.sh                        # the default parts: check, then phases, loop and steps
#   bash benchmarks/gpu_session.sh phases loop steps      # ≈ 7 min on an H200 (phases needs MNIST under data/MNIST/raw)
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh autoattack
#
# Parts (minutes measured on an H200 where known; phases, steps and horizon run two commands, each under the part's
# limit):
#   check       benchmarks/gpu_check.py --quick: the gpu-marked tests, a fit of every stabilizer, the GPU–CPU
#               comparison (its README promise: at most 525 s)
#   phases      the MNIST config's 10 epochs by phase, eager and with CUDA graphs (--model.compile_mode
#               reduce-overhead) (1.3 min eager on 2026-11-28)
#   loop        stability fit against the hand-written loop, eager and captured (0.5 min)
#   steps       the matrix-product rates the step model prices (bf16, TF32, IEEE float32, 3xTF32: benchmarks/
#               matmul_rates.py, seconds); a ViT-S layer's norms alone (benchmarks/norm_kernels.py: whether CUDA's
#               norm kernels cost by their rows or their bytes, seconds); every stabilizer's training step, ViT-S at
#               256 tokens, bf16, eager (1.6 min);
#               then the baseline, qk_norm and JaSMin eager and compiled (a second command: a cut there keeps the eager
#               table); last, the hard cap's second signs batched four ways on ViT-S, Swin-T and CSwin-T
#               (benchmarks/cap_batches.py: whether joining more widths pays on a GPU), IEEE and 3xTF32 products
#   autoattack  the official AutoAttack ℓ2 1.58 on all 10,000 MNIST test images for the published certified
#               transformer, batches sized by the GPU's memory, the network compiled (target: ≤ 10 min); needs the
#               MNIST files under data/MNIST/raw
#   workers     four short digits runs swept with --workers 1, 2, 4 on the one GPU (the sweep's speed-up; its CPU proxy
#               is results/benchmarks/sweep_workers_cpu.md)
#   measure     every measurement's cost per point at batch 256 (micro ViT on digits), with the attacks, the one-pass
#               exact local estimate and the lower bound compiled (--robustness.compile, --lipschitz.compile); its CPU
#               table is results/benchmarks/measurement_cost_compiled_cpu.md (3.9 min on 1 thread; unmeasured here)
#   wide        the hybrid at the anchor's size (embed_dim 248: 1.98 M parameters) on the 60-epoch schedule, the study
#               configs/experiments/mnist/certified_hybrid.yaml's run of it (MNIST under data/MNIST/raw)
#   horizon     GloRo's 300 epochs for the 4C3F anchor and the hybrid (configs/lipcnn_mnist.yaml, configs/hybrid_mnist.yaml),
#               MNIST under data/MNIST/raw
# A run of wide or horizon cut at its limit resumes from its last epoch when the part runs again on the same machine
# with the same RUNS folder (its checkpoints do not come back from a lent machine); each run's logs, events and results
# come back as $OUT/<part>.tar.gz after every command.
#
# Environment: OUT (default results/benchmarks/gpu_session), LIMIT_<PART> (seconds; defaults below, each command of a
# part under one 10-minute device call), RUNS (the run folder of wide and horizon, default runs/horizon). Wheels in
# .whl/ (for a machine without a package index) are installed first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/benchmarks/gpu_session}
RUNS=${RUNS:-runs/horizon}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
LOG="$OUT/session.log"

say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

# run NAME LIMIT COMMAND…: the command under its limit (SIGINT first, so Python writes what it has; SIGKILL 20 s
# later); its output goes to the log, its last lines to the screen.
run() {
    local name=$1 limit=$2 start status
    shift 2
    say "$name: start (limit ${limit} s): $*"
    start=$(date +%s)
    timeout -s INT -k 20 "$limit" "$@" > "$LOG.$name" 2>&1
    status=$?
    tail -n 5 "$LOG.$name"
    cat "$LOG.$name" >> "$LOG" && rm -f "$LOG.$name"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        say "$name: cut at its limit after $(( $(date +%s) - start )) s"
    else
        say "$name: exit $status after $(( $(date +%s) - start )) s"
    fi
}

part_check() {
    run check "${LIMIT_CHECK:-540}" python benchmarks/gpu_check.py --quick --out "$OUT/gpu_check.md"
}

part_phases() {
    run phases "${LIMIT_PHASES:-150}" python benchmarks/epoch_phases.py --device cuda --epochs 10 \
        --out "$OUT/epoch_phases_eager.md"
    run phases_captured "${LIMIT_PHASES:-150}" python benchmarks/epoch_phases.py --device cuda --epochs 10 \
        --out "$OUT/epoch_phases_captured.md" -- --model.compile true --model.compile_mode reduce-overhead
}

part_loop() {
    run loop "${LIMIT_LOOP:-90}" python benchmarks/loop_overhead.py --device cuda --out "$OUT/loop_overhead.md"
}

part_steps() {
    run matmul_rates "${LIMIT_MATMUL:-60}" python benchmarks/matmul_rates.py --device cuda --out "$OUT/matmul_rates.md"
    run norm_kernels "${LIMIT_NORMS:-60}" python benchmarks/norm_kernels.py --device cuda --out "$OUT/norm_kernels.md"
    run steps "${LIMIT_STEPS:-360}" python benchmarks/step_cost.py --device cuda --backbones vit:small --tokens 256 \
        --precision bf16 --repeats 3 --out "$OUT/step_cost.md"
    run steps_compiled "${LIMIT_STEPS:-360}" python benchmarks/step_cost.py --device cuda --backbones vit:small \
        --tokens 256 --precision bf16 --repeats 3 --cases "none;qk_norm;jasmin k=10" --compiled "qk_norm;jasmin k=10" \
        --out "$OUT/step_cost_compiled.md"
    run cap_batches "${LIMIT_CAPS:-90}" python benchmarks/cap_batches.py --device cuda \
        --backbones vit:small,swin:tiny,cswin:tiny --shares 1,4 --repeats 7 --out "$OUT/cap_batches.md"
    run cap_batches_tf32x3 "${LIMIT_CAPS:-90}" python benchmarks/cap_batches.py --device cuda --cap_products tf32x3 \
        --backbones vit:small,swin:tiny,cswin:tiny --shares 1,4 --repeats 7 --out "$OUT/cap_batches_tf32x3.md"
}

part_autoattack() {
    run autoattack "${LIMIT_AUTOATTACK:-600}" python -m stability test \
        --ckpt_path results/certified_transformers/certified_transformer_gloro_100ep.ckpt --data.root data \
        --run_dir "$OUT/autoattack_run" --lipschitz.every_n_epochs 0 --robustness.test_attacks '[autoattack]' \
        --robustness.autoattack_eps '[]' --robustness.autoattack_l2_eps '[1.58]' \
        --robustness.autoattack_num_points 10000 --robustness.autoattack_batch_size memory \
        --robustness.compile true
}

part_workers() {
    run workers "${LIMIT_WORKERS:-300}" python benchmarks/sweep_workers.py --device cuda --workers 1,2,4 --runs 4 \
        --out "$OUT/sweep_workers.md"
}

# pack NAME DIR: DIR's logs, events and results (no checkpoints: too large to come back from a lent machine) as
# $OUT/NAME.tar.gz, one file, so that a run's results leave the machine even when its folder cannot.
pack() {
    [ -d "$2" ] && tar czf "$OUT/$1.tar.gz" --exclude='*.ckpt' --exclude=measurements -C "$2" . \
        && say "$1: its run folder without checkpoints is $OUT/$1.tar.gz"
}

part_measure() {
    run measure "${LIMIT_MEASURE:-420}" python benchmarks/measurement_cost.py --device cuda --batch 256 --compile \
        --autoattack_points 0 --out "$OUT/measurement_cost.md"
}

part_wide() {
    run wide "${LIMIT_WIDE:-540}" python -m stability sweep configs/experiments/mnist/certified_hybrid.yaml \
        --sweeps_dir "$RUNS" --workers 1 --only 'model.backbone_options=embed_dim-248,trainer.max_epochs=60,seed=0'
    pack wide "$RUNS/certified_hybrid/model.backbone_options=embed_dim-248,trainer.max_epochs=60,seed=0"
}
part_horizon() {
    local common=(--trainer.max_epochs 300 --test_after_fit true --timing.enabled true --robustness.every_n_epochs 1
                  --robustness.num_points 2000 --robustness.attacks '[]' --robustness.test_attacks '[]'
                  --robustness.certified_radii '[0.5, 1.0, 1.58]' --lipschitz.every_n_epochs 1000
                  --best_checkpoint certified/acc_L2_1.58 --trainer.enable_progress_bar false)
    for model in anchor hybrid; do
        local configs=(--config configs/hybrid_mnist.yaml)
        [ "$model" = anchor ] && configs=(--config configs/lipcnn_mnist.yaml --config configs/stabilizer/gloro_mnist.yaml)
        local resume=()
        [ -f "$RUNS/$model/checkpoints/last.ckpt" ] && resume=(--ckpt_path "$RUNS/$model/checkpoints/last.ckpt")
        run "horizon_$model" "${LIMIT_HORIZON:-270}" python -m stability fit "${configs[@]}" "${common[@]}" \
            --run_dir "$RUNS/$model" ${resume[@]+"${resume[@]}"}
        pack "horizon_$model" "$RUNS/$model"
    done
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(check phases loop steps)
for part in "${parts[@]}"; do
    if ! declare -F "part_$part" > /dev/null; then
        say "unknown part '$part': valid parts are check, phases, loop, steps, autoattack, workers, measure, wide, horizon"
        exit 2
    fi
done
say "GPU session: parts ${parts[*]}; $(python -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1)"
for part in "${parts[@]}"; do
    "part_$part"
done
say "done"
