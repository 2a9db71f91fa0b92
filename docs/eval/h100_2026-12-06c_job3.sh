# session 49c: XLA's GEMM picks tuned in context (scripts/tune_autotune.py), then the eval with the kept picks
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
mkdir -p /root/pack /root/logs; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 420 python3 scripts/tune_autotune.py --engine spec --trials 4 --install --json /root/pack/tune_spec.json > /root/logs/tune_spec.log 2>&1
echo "TUNE spec rc $? at $(( $(date +%s)-t0 ))s"; grep -v -i "warn\|I0000\|absl" /root/logs/tune_spec.log | tail -7
timeout 200 python3 scripts/tune_autotune.py --engine plain --trials 2 --install --json /root/pack/tune_plain.json > /root/logs/tune_plain.log 2>&1
echo "TUNE plain rc $? at $(( $(date +%s)-t0 ))s"; grep -v -i "warn\|I0000\|absl" /root/logs/tune_plain.log | tail -5
echo TUNEDONE
ls /root/sj/jax-cache | head -3; ls /root/sj/jax-cache/xla_gpu_per_fusion_autotune_cache_dir | wc -l
timeout 480 python3 -m specjax.cli eval --limit 10 --max-tokens 256 --max-batch 1 --min-accept none --repeats 2 --json /root/pack/eval_tuned.json > /root/logs/eval_tuned.log 2>&1
echo "EVAL tuned rc $? at $(( $(date +%s)-t0 ))s"; python3 .devcarry/jobs/summ.py /root/pack/eval_tuned.json | tail -8
echo ALLDONE
