#!/usr/bin/env bash
# Train the EAGLE-3 head shipped for the default model (SmolLM2-135M-Instruct) on ONE GPU, in one
# call of under 10 minutes, offline. Run from the repository root:
#
#   bash scripts/train_default_head.sh [PROMPTS.jsonl]      # default: data/train/gsm8k_train.jsonl
#
# Stages (each prints its timing; both resume):
#   1. data   target responses to the training prompts at temperatures 0 / 0.7 / 1.0 (one per
#             prompt, in turn), max 256 tokens, then the target's aux hidden states + greedy next
#             tokens per token -> $RUN/data (npz shards). Stops starting new chunks after
#             DATA_BUDGET seconds. SKIP_DATA=1 reuses existing shards as they are.
#   2. train  STEPS steps (stops earlier after TRAIN_BUDGET seconds), checkpoints in $RUN/work
#             (a second run resumes), then exports the head to $OUT (bf16) with TRAINING.md.
# Needs the converted default model at $MODEL (checkpoints/smollm2-135m-instruct).
# PACK_TO=DIR (e.g. the device machine's $OUT) also writes the head as a .tgz split into parts of
# 15 MB (reassemble: cat eagle3-head.tgz.part-* | tar -xzf - -C checkpoints) plus the logs and plot.
# Afterwards, measure acceptance and speed-up:
#   specjax eval --draft $OUT --limit 20 --json eval.json --markdown eval.md --png eval.png
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPTS=${1:-data/train/gsm8k_train.jsonl}
MODEL=${MODEL:-checkpoints/smollm2-135m-instruct}
RUN=${RUN:-runs/eagle3-smollm2-135m}
OUT=${OUT:-checkpoints/eagle3-smollm2-135m}
MAX_PROMPTS=${MAX_PROMPTS:-7473}
DATA_BUDGET=${DATA_BUDGET:-180}
MAX_BATCH=${MAX_BATCH:-256}
MAX_TOKENS=${MAX_TOKENS:-256}
STEPS=${STEPS:-2000}
TRAIN_BUDGET=${TRAIN_BUDGET:-240}
BATCH=${BATCH:-16}
SEQ_LEN=${SEQ_LEN:-1024}
LR=${LR:-6e-4}
TTT=${TTT:-5}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
PY=${PYTHON:-python3}

for alt in "shared/data/train/$(basename "$PROMPTS")" "../shared/data/train/$(basename "$PROMPTS")"; do
  if [ ! -f "$PROMPTS" ] && [ -f "$alt" ]; then PROMPTS=$alt; fi
done
[ -f "$PROMPTS" ] || { echo "no prompt file $PROMPTS" >&2; exit 1; }
[ -f "$MODEL/specjax.json" ] || { echo "no converted model at $MODEL (specjax download-default)" >&2; exit 1; }
"$PY" - <<'PYEOF'
import importlib.util, jax, optax, orbax.checkpoint  # required (optax, orbax: training, checkpoints)
print("jax", jax.__version__, jax.devices(), "optax", optax.__version__)
print("optional:", {m: importlib.util.find_spec(m) is not None for m in ("tqdm", "matplotlib")})
PYEOF

T0=$SECONDS
if [ "${SKIP_DATA:-0}" = "1" ] && [ -f "$RUN/data/manifest.json" ]; then
  echo "== data: skipped (SKIP_DATA=1, $RUN/data exists)"
else
  echo "== data: $PROMPTS -> $RUN/data (max $MAX_PROMPTS prompts, budget ${DATA_BUDGET}s)"
  "$PY" scripts/train_eagle.py data --prompts "$PROMPTS" --out "$RUN/data" --model "$MODEL" \
    --max-prompts "$MAX_PROMPTS" --temperatures 0,0.7,1.0 --max-tokens "$MAX_TOKENS" --max-seq-len 768 \
    --max-batch "$MAX_BATCH" --chunk-prompts 1024 --data-time-budget "$DATA_BUDGET"
fi
echo "== data stage: $((SECONDS - T0)) s"

T1=$SECONDS
echo "== train: $STEPS steps (budget ${TRAIN_BUDGET}s), batch $BATCH x $SEQ_LEN, K=$TTT -> $OUT"
"$PY" scripts/train_eagle.py train --data "$RUN/data" --work "$RUN/work" --export "$OUT" --resume \
  --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ_LEN" --lr "$LR" --warmup 100 \
  --ttt-steps "$TTT" --draft-vocab "$DRAFT_VOCAB" --ckpt-every 500 --log-every 25 \
  --time-budget "$TRAIN_BUDGET" --export-dtype bfloat16
echo "== train stage: $((SECONDS - T1)) s; total $((SECONDS - T0)) s"
{
  echo
  echo "## Reproduce"
  echo
  echo '```bash'
  echo "MAX_PROMPTS=$MAX_PROMPTS DATA_BUDGET=$DATA_BUDGET MAX_BATCH=$MAX_BATCH MAX_TOKENS=$MAX_TOKENS STEPS=$STEPS TRAIN_BUDGET=$TRAIN_BUDGET \\"
  echo "  BATCH=$BATCH SEQ_LEN=$SEQ_LEN LR=$LR TTT=$TTT DRAFT_VOCAB=$DRAFT_VOCAB bash scripts/train_default_head.sh $PROMPTS"
  echo '```'
  echo
  echo "Wall time on $("$PY" -c "import jax; print(jax.devices()[0].device_kind)"): data stage $((T1 - T0)) s, train stage $((SECONDS - T1)) s."
} >> "$OUT/TRAINING.md"
du -sh "$OUT"
cat "$OUT/TRAINING.md"
if [ -n "${PACK_TO:-}" ]; then
  mkdir -p "$PACK_TO"
  tar -C "$(dirname "$OUT")" -czf - "$(basename "$OUT")" | split -b 15m - "$PACK_TO/eagle3-head.tgz.part-"
  cp "$OUT/TRAINING.md" "$OUT/curves.png" "$RUN/work/train_log.jsonl" "$RUN/work/summary.json" "$PACK_TO/"
  cp "$RUN/data/manifest.json" "$PACK_TO/data_manifest.json"
  ls -la "$PACK_TO"
fi
