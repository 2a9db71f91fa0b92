#!/usr/bin/env bash
# Rebuild the EAGLE-3 head shipped for the default model (SmolLM2-135M-Instruct) end to end on GPUS
# GPUs of one machine (default: all visible), offline, from nothing but the target and the GSM8K
# training prompts. Run from the repository root (each stage prints its timing; data and training
# resume when run again):
#
#   bash scripts/train_default_head.sh
#
# On N GPUs, stages 0 and 1 run N processes (process i on GPU i, a share of the prompts / of the
# chunks each, joined afterwards) and stage 2 is data parallel over the N GPUs (BATCH rows per GPU,
# so a step takes N x BATCH rows). GPUS=1 is the one-GPU pipeline.
#
#   0. prompts  user messages written by the target itself (its chat template up to the user turn
#               + an opener, T=1, top-p 0.95; SELF_INSTRUCT of them) and task prompts over the
#               text of the installed Python (docstrings and code: summarize, answer from a passage,
#               extract, rewrite, translate, explain / document / test / continue code; PASSAGES of
#               them, built on the CPU while the GPU writes the self-instruct ones) and SCHEMAS
#               prompts with random JSON schemas, answered under their schema in stage 1
#               (specjax.train.schemas)
#   1. data     the target's responses (specjax's engine, MAX_BATCH rows, temperatures 0/0.7/0/1.0
#               in turn, up to MAX_TOKENS; IGNORE_EOS_SHARE of the prompts past the end of the turn, to
#               MAX_TOKENS) to GSM8K train + those prompts, as token ids only; each
#               process stops starting new chunks after DATA_BUDGET seconds
#   2. train    EAGLE-3 training-time test over TTT steps, the target's features computed inside the
#               training step, 1 % of the packed rows held out (acc@1..TTT in the log, curves.png);
#               STEPS steps or TRAIN_BUDGET seconds; exports the head to $OUT with TRAINING.md
# Evaluation prompt sets (data/prompts/*) are never used. Needs the converted default model at $MODEL
# (default: specjax's, fetched and converted if missing).
# PACK_TO=DIR also writes the head as a .tgz split into 15 MB parts (reassemble:
# cat eagle3-head.tgz.part-* | tar -xzf - -C checkpoints) plus the logs and the plot.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
MODEL=${MODEL:-$("$PY" -c "from specjax.default_model import ensure_default; print(ensure_default())")}
RUN=${RUN:-runs/eagle3-smollm2-135m}
OUT=${OUT:-checkpoints/eagle3-smollm2-135m}
GSM8K=${GSM8K:-data/train/gsm8k_train.jsonl}
SELF_INSTRUCT=${SELF_INSTRUCT:-30000}
PASSAGES=${PASSAGES:-30000}
IGNORE_EOS_SHARE=${IGNORE_EOS_SHARE:-0}  # share of the prompts answered past the end of the turn (EOS ignored, to MAX_TOKENS)
SCHEMAS=${SCHEMAS:-0}  # prompts with random JSON schemas, answered under the schema (specjax.train.schemas); off by
# default: each schema's token DFA costs 0.1-1.4 s of host time when its request is admitted (SmolLM2 vocabulary),
# ~460 schemas per 8 192-prompt chunk kept the GPU idle for minutes (H200, 2026-11-26)
DATA_BUDGET=${DATA_BUDGET:-540}
MAX_BATCH=${MAX_BATCH:-512}
MAX_TOKENS=${MAX_TOKENS:-512}
CHUNK=${CHUNK:-8192}  # prompts per data chunk (a process starts no new chunk after DATA_BUDGET seconds)
STEPS=${STEPS:-4000}
TRAIN_BUDGET=${TRAIN_BUDGET:-540}
BATCH=${BATCH:-16}  # rows per GPU
SEQ_LEN=${SEQ_LEN:-1024}
LR=${LR:-6e-4}
TTT=${TTT:-7}
DRAFT_VOCAB=${DRAFT_VOCAB:-}  # empty: 16384, or INIT_HEAD's; larger than INIT_HEAD's: grown (train_eagle.py --draft-vocab)
SEED=${SEED:-0}  # prompts, sampling and data order (a new seed: new prompts and responses)
INIT_HEAD=${INIT_HEAD:-}  # continue training this exported head (its weights and draft vocabulary)
HEAD_INTERMEDIATE=${HEAD_INTERMEDIATE:-}  # empty: INIT_HEAD's MLP width, or the target's; wider: grown (train_eagle.py --head-intermediate)
WARMUP=${WARMUP:-200}
if [ -z "${GPUS:-}" ]; then  # all visible GPUs (1 without any)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then GPUS=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c . || true)
  elif command -v nvidia-smi > /dev/null; then GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
  fi
  [ "${GPUS:-0}" -ge 1 ] || GPUS=1
fi

for alt in "shared/data/train/$(basename "$GSM8K")" "../shared/data/train/$(basename "$GSM8K")"; do
  if [ ! -f "$GSM8K" ] && [ -f "$alt" ]; then GSM8K=$alt; fi
done
[ -f "$GSM8K" ] || { echo "no GSM8K training prompts at $GSM8K" >&2; exit 1; }
[ -f "$MODEL/specjax.json" ] || { echo "no converted model at $MODEL (specjax download-default)" >&2; exit 1; }
mkdir -p "$RUN"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== $GPUS GPU(s)"

T0=$SECONDS
if [ -f "$RUN/prompts.jsonl" ]; then
  echo "== prompts: reusing $RUN/prompts.jsonl ($(wc -l < "$RUN/prompts.jsonl") prompts)"
else
  echo "== prompts: $PASSAGES over installed Python text (CPU, background) + $SELF_INSTRUCT written by the target"
  JAX_PLATFORMS=cpu "$PY" scripts/train_eagle.py prompts --out "$RUN/passages.jsonl" --self-instruct 0 --passages "$PASSAGES" --schemas "$SCHEMAS" --seed "$SEED" --workers "$GPUS" &
  PASS_PID=$!
  "$PY" scripts/train_eagle.py prompts --out "$RUN/self_instruct.jsonl" --model "$MODEL" \
    --self-instruct "$SELF_INSTRUCT" --passages 0 --max-batch 1024 --seed "$SEED" --workers "$GPUS"
  wait $PASS_PID
  cat "$RUN/self_instruct.jsonl" "$RUN/passages.jsonl" > "$RUN/prompts.jsonl"
fi
echo "== prompts stage: $((SECONDS - T0)) s"

T1=$SECONDS
echo "== data: $GSM8K + $RUN/prompts.jsonl -> $RUN/data (token ids; budget ${DATA_BUDGET}s)"
"$PY" scripts/train_eagle.py data --prompts "$GSM8K" "$RUN/prompts.jsonl" --out "$RUN/data" --model "$MODEL" \
  --no-features --temperatures 0,0.7,0,1.0 --max-tokens "$MAX_TOKENS" --ignore-eos-share "$IGNORE_EOS_SHARE" --max-seq-len 1024 \
  --max-batch "$MAX_BATCH" --chunk-prompts "$CHUNK" --data-time-budget "$DATA_BUDGET" --data-seed "$SEED" --workers "$GPUS"
echo "== data stage: $((SECONDS - T1)) s"

T2=$SECONDS
echo "== train: $STEPS steps (budget ${TRAIN_BUDGET}s), batch $GPUS x $BATCH x $SEQ_LEN, TTT $TTT -> $OUT"
"$PY" scripts/train_eagle.py train --data "$RUN/data" --work "$RUN/work" --export "$OUT" --resume \
  --steps "$STEPS" --batch-size "$BATCH" --devices "$GPUS" --seq-len "$SEQ_LEN" --lr "$LR" --warmup "$WARMUP" --seed "$SEED" \
  ${INIT_HEAD:+--init-head "$INIT_HEAD"} \
  --ttt-steps "$TTT" ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} ${HEAD_INTERMEDIATE:+--head-intermediate "$HEAD_INTERMEDIATE"} --ckpt-every 1000 --log-every 50 --eval-every 500 \
  --heldout 0.01 --time-budget "$TRAIN_BUDGET" --export-dtype bfloat16 --no-progress
echo "== train stage: $((SECONDS - T2)) s; total $((SECONDS - T0)) s"
{
  echo
  echo "## Reproduce"
  echo
  echo '```bash'
  echo "GPUS=$GPUS SEED=$SEED INIT_HEAD=$INIT_HEAD WARMUP=$WARMUP SELF_INSTRUCT=$SELF_INSTRUCT PASSAGES=$PASSAGES SCHEMAS=$SCHEMAS DATA_BUDGET=$DATA_BUDGET CHUNK=$CHUNK MAX_BATCH=$MAX_BATCH MAX_TOKENS=$MAX_TOKENS \\"
  echo "  STEPS=$STEPS TRAIN_BUDGET=$TRAIN_BUDGET BATCH=$BATCH SEQ_LEN=$SEQ_LEN LR=$LR TTT=$TTT DRAFT_VOCAB=$DRAFT_VOCAB HEAD_INTERMEDIATE=$HEAD_INTERMEDIATE \\"
  echo "  bash scripts/train_default_head.sh"
  echo '```'
  echo
  echo "Wall time on $GPUS x $("$PY" -c "import jax; print(jax.devices()[0].device_kind)"): prompts $((T1 - T0)) s, data $((T2 - T1)) s, train $((SECONDS - T2)) s."
} >> "$OUT/TRAINING.md"
du -sh "$OUT"
if [ -n "${PACK_TO:-}" ]; then
  mkdir -p "$PACK_TO"
  tar -C "$(dirname "$OUT")" -czf - "$(basename "$OUT")" | split -b 15m - "$PACK_TO/eagle3-head.tgz.part-"
  cp "$RUN/work/train_log.jsonl" "$RUN/work/summary.json" "$PACK_TO/"
  cp "$RUN/data/manifest.json" "$PACK_TO/data_manifest.json"
  ls -la "$PACK_TO"
fi
