#!/usr/bin/env bash
# Every GPU measurement of vitscale in one script, for a bare one-GPU machine (minutes of GPU time).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (OUT_DIR defaults to $OUT, else ./gpu-check)
#
# What such a machine lacks comes from wheels carried in .whl/ (DeepSpeed built here with DS_BUILD_OPS=0,
# pydantic and its core, hjson, simplejpeg, boto3 and its parts): `make gpu-wheels` fetches them. Then,
# in order of what matters most, under one deadline (GPU_CHECK_SECONDS, default 480: the whole script, the
# wheels' install included, in 8 minutes; a 10-minute call keeps the rest for the tar of OUT_DIR and a margin),
# each part with its own cap besides:
#   0. benchmarks/update_pass.py: the optimizer's update alone for ViT-B/16 and ViT-L/16, DeepSpeed's passes
#      against vitscale's one-pass AdamW (`train/one_pass.py`) and the peer's (seconds);
#   1. the GPU tests (bf16 over NCCL at ZeRO 0-3, compiled, exact resume; the one-pass update against
#      DeepSpeed's; the step's, the update's and ZeRO 3's host syncs);
#   2. benchmarks/mfu.py: vitscale's training step against the hand-written peer (timm + compile + fused
#      AdamW + bf16 autocast) for ViT-B/16 at ZeRO 1, 3 and 2 (ZeRO 3's open target before 2's met one; a
#      torch.profiler summary of each) and ViT-L/16 at ZeRO 1, batch 256, with the forward / backward /
#      optimizer phases and the update's GPU time in a step;
#   3. benchmarks/train_data.py: the real worker loop on >= 20,000 JPEGs written here, against the fixed batch;
#   4. the extras, each only where its whole cap still fits: ViT-L/16 at ZeRO 1 with
#      `train.compile_mode: max-autotune-no-cudagraphs` (matmul and fusion configurations searched: whether it
#      beats the default mode's 47.6% MFU, 2026-12-01; never reached so far); the same with inductor's
#      coordinate-descent tuning alone (its own kernels tuned, no matmul search; 120 s did not finish its compile
#      on 2026-12-01); ViT-L/16 at ZeRO 2; the real loop on 1,200 JPEGs, an epoch every 4.7 steps (the loader kept
#      across epochs); ViT-Ti/16 and S/16 at ZeRO 1 against the peer (Ti/16's short step waits for the host: 0.91x
#      the peer on 2026-12-01); ViT-B/16 eager at ZeRO 0 and 3; benchmarks/attention.py, every attention kernel at each ViT's shapes (seconds); ViT-B/16 at ZeRO 1
#      compiled with CUDA graphs (`train.compile_mode: reduce-overhead`); ViT-B/16 at the largest batch its
#      memory holds (`--batch auto`); ViT-L/16 at the largest batch its memory holds, the peer at the same
#      (150 s). CUDA graphs and ViT-L/16's batch 576 gained nothing on 2026-11-30; ViT-B/16's batch 1024 reached
#      41.3% MFU on 2026-12-01 (benchmarks/RESULTS.md).
# A machine that hands back a few files only (8, 16 MiB each): the tables and logs in one archive, the profiles'
# Chrome traces (one per ZeRO stage, a few MiB at most) beside it, so that a large trace never costs the tables:
#   bash benchmarks/gpu_check.sh /tmp/gc; tar czf $OUT/gc.tgz --exclude='*.trace.json.gz' -C /tmp gc; cp /tmp/gc/*.trace.json.gz $OUT/
# GPU_CHECK_ONLY="l16 tests" runs only the parts so named (update b16 l16 data tests autotune l16-tuned l16-zero2
# data-epochs small eager attention graphs b16-auto l16-auto), e.g. a second, shorter call for what the first one's
# deadline skipped.
# Tables and logs land in OUT_DIR; the last lines printed are the tables.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
deadline=${GPU_CHECK_SECONDS:-480}  # see `part` and `extra` below
if ! [[ $deadline =~ ^[0-9]+$ ]]; then
  echo "gpu_check.sh: GPU_CHECK_SECONDS must be a whole number of seconds, got '$deadline'" >&2
  exit 2
fi
parts="update b16 l16 data tests autotune l16-tuned l16-zero2 data-epochs small eager attention graphs b16-auto l16-auto"
for name in ${GPU_CHECK_ONLY:-}; do
  if [[ " $parts " != *" $name "* ]]; then
    echo "gpu_check.sh: GPU_CHECK_ONLY names no part '$name' (the parts: $parts)" >&2
    exit 2
  fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
python=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
stamp() { echo "== $(date +%H:%M:%S) $*"; }
# One deadline for the whole script (bash's SECONDS counts from its start), so a slow part shortens the
# ones after it instead of running the lease out: `part` gives a command at most WANT seconds and never
# past the deadline; `extra` runs only where its whole WANT still fits.
only=" ${GPU_CHECK_ONLY:-} "
# Each call below reads `chosen NAME && part WANT TITLE COMMAND...`: a part not chosen starts nothing, its log's `tee`
# included (an empty log would read as a part that ran and printed nothing).
chosen() { [[ $only == "  " || $only == *" $1 "* ]]; }
part() {
  local want=$1 title=$2 left=$(( deadline - SECONDS )); shift 2
  if (( left < 30 )); then stamp "skipped, the deadline is near: $title"; return 0; fi
  stamp "$title"
  timeout $(( want < left ? want : left )) "$@"
}
extra() {
  local want=$1 title=$2; shift 2
  if (( deadline - SECONDS < want )); then stamp "skipped, no time left for it: $title"; return 0; fi
  stamp "$title"
  timeout "$want" "$@"
}
stamp "machine"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$python -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1

chosen update && part 45 "the update alone" $python benchmarks/update_pass.py --steps 20 --out "$out/update_pass.json" 2>&1 \
  | tee "$out/update_pass.log" | tail -9
# The GPU tests before the benchmarks: a step that is wrong is worth no figure.
chosen tests && part 160 "gpu tests" $python -m pytest -m gpu tests/test_gpu_training.py tests/test_flops.py tests/test_bench_mfu.py \
  -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | grep -v DEBUG | tail -8
chosen b16 && part 200 "mfu ViT-B/16" $python benchmarks/mfu.py --models ViT-B/16 --zero-stages 1 3 2 --peer --steps 16 \
  --profile "$out" --out "$out/mfu_b16.json" 2>&1 | tee "$out/mfu_b16.log" | grep -v '^{'
chosen l16 && part 170 "mfu ViT-L/16" $python benchmarks/mfu.py --models ViT-L/16 --zero-stages 1 --peer --steps 10 \
  --out "$out/mfu_l16.json" 2>&1 | tee "$out/mfu_l16.log" | grep -v '^{'
# 20,000 JPEGs and their shards take ~45 s, the fixed batch's compile and steps ~35 s, the loop ~30 s.
chosen data && part 150 "train_data ViT-B/16" $python benchmarks/train_data.py --steps 40 --fixed-steps 10 --decode-seconds 3 \
  --out "$out/train_data.json" 2>&1 | tee "$out/train_data.log" | tail -25
# The extras, each only where its whole time still fits before the deadline, the open questions first.
# Searching configurations compiles for minutes (ViT-L/16's default compile took ~50 s of its 100-s part).
chosen autotune && extra 190 "mfu ViT-L/16, compile mode max-autotune-no-cudagraphs" \
  $python benchmarks/mfu.py --models ViT-L/16 --zero-stages 1 --compile-mode max-autotune-no-cudagraphs \
  --steps 8 --out "$out/mfu_l16_autotune.json" 2>&1 | tee "$out/mfu_l16_autotune.log" | grep -v '^{' | tail -6
# Half of max-autotune: inductor's coordinate-descent tuning of its own kernels (layer norms, GELU, residual adds,
# the one-pass update: a fifth or so of a step), without the matmul search. Whether it lifts ViT-L/16 above the
# default mode (inductor reads the variable when torch is imported; the same measurement otherwise); its compile
# outlasted 120 s on 2026-12-01.
chosen l16-tuned && extra 240 "mfu ViT-L/16, inductor's coordinate-descent tuning" env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 \
  $python benchmarks/mfu.py --models ViT-L/16 --zero-stages 1 --steps 8 --out "$out/mfu_l16_tuned.json" 2>&1 \
  | tee "$out/mfu_l16_tuned.log" | grep -v '^{' | tail -6
chosen l16-zero2 && extra 110 "mfu ViT-L/16, ZeRO 2" $python benchmarks/mfu.py --models ViT-L/16 --zero-stages 2 --steps 8 \
  --out "$out/mfu_l16_zero2.json" 2>&1 | tee "$out/mfu_l16_zero2.log" | grep -v '^{' | tail -6
# 1,200 JPEGs at batch 256: an epoch every 4 steps, where the loader's processes were started again every epoch
# until 2026-11-30 (now kept: benchmarks/RESULTS.md, "One loader for every epoch").
chosen data-epochs && extra 110 "train_data ViT-B/16 on 1,200 JPEGs, an epoch every 4 steps" \
  $python benchmarks/train_data.py --images 1200 --steps 40 --fixed-steps 10 --decode-seconds 2 \
  --out "$out/train_data_epochs.json" 2>&1 | tee "$out/train_data_epochs.log" | tail -12
# A small ViT's step is short on an H200 (a few ms at batch 256): where the host's side of a step (DeepSpeed's
# engine, its per-parameter gradient hooks, the update's launches) takes longer than the GPU's, the GPU waits.
# ViT-Ti/16 and S/16 against the peer say whether it does: on 2026-12-01 Ti/16 ran at 0.91x, S/16 at 1.07x, before
# one rank's norm and clip factor became one compiled call (`train/fused.py` `one_rank_norm`) and the hooks' count
# of used parameters stopped making a view per parameter (`train/grad_hooks.py`); neither yet on a GPU.
chosen small && extra 110 "mfu ViT-Ti/16 and ViT-S/16, ZeRO 1, against the peer" $python benchmarks/mfu.py \
  --models ViT-Ti/16 ViT-S/16 --zero-stages 1 --peer --steps 16 --out "$out/mfu_small.json" 2>&1 \
  | tee "$out/mfu_small.log" | grep -v '^{' | tail -8
chosen eager && extra 60 "mfu ViT-B/16, ZeRO 0 and ZeRO 3 eager (the main run's ZeRO 3 row is compiled)" \
  $python benchmarks/mfu.py --models ViT-B/16 --zero-stages 0 3 --compile off --steps 8 \
  --out "$out/mfu_b16_eager.json" 2>&1 | tee "$out/mfu_b16_eager.log" | grep -v '^{' | tail -6
chosen attention && extra 40 "attention kernels" $python benchmarks/attention.py --steps 10 --out "$out/attention.json" 2>&1 \
  | tee "$out/attention.log" | grep -v '^{' | tail -7
chosen graphs && extra 75 "mfu ViT-B/16, CUDA graphs" $python benchmarks/mfu.py --models ViT-B/16 --zero-stages 1 \
  --compile-mode reduce-overhead --steps 8 --out "$out/mfu_b16_graphs.json" 2>&1 \
  | tee "$out/mfu_b16_graphs.log" | grep -v '^{' | tail -6
chosen b16-auto && extra 60 "mfu ViT-B/16, the batch chosen by memory" $python benchmarks/mfu.py --models ViT-B/16 --batch auto \
  --zero-stages 1 --steps 8 --out "$out/mfu_b16_auto.json" 2>&1 | tee "$out/mfu_b16_auto.log" | grep -v '^{' | tail -6
# ViT-L/16 at the batch its memory holds (576 on an H200): two eager probes, then both loops compiled at it.
chosen l16-auto && extra 150 "mfu ViT-L/16, the batch chosen by memory (both loops)" \
  $python benchmarks/mfu.py --models ViT-L/16 --batch auto --zero-stages 1 --peer --steps 4 \
  --out "$out/mfu_l16_auto.json" 2>&1 | tee "$out/mfu_l16_auto.log" | grep -v '^{'
stamp "done"
