# next GPU job (session 50+), for .devcarry/jobs/: the four fewer kernels (compile-only 539 -> 535) measured against
# session 48's code on one machine, then --install of scripts/tune_autotune.py checked on a GPU.
# Before the calls: git archive 30a0e4b -o .devcarry/old.tar (session 48's code) and carry it with .devcarry/jobs.
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
mkdir -p /root/pack /root/logs /root/old; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
tar -xf .devcarry/old.tar -C /root/old
E="eval --limit 10 --max-tokens 256 --max-batch 1 --min-accept none --repeats 2"
ev() {  # name dir: each eval in its own code tree, the same machine and cache directory
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 480 python3 -m specjax.cli $E --json /root/pack/$1.json > /root/logs/$1.log 2>&1)
  echo "EVAL $1 rc $? at $(( $(date +%s)-t0 ))s"; python3 .devcarry/jobs/summ.py /root/pack/$1.json | tail -2
}
ev eval_new $(pwd)
ev eval_old /root/old
echo EVALDONE
prof() {  # name dir
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 240 python3 scripts/profile_step.py --max-tokens 128 --ops 60 \
     --json /root/pack/prof_$1.json > /root/logs/prof_$1.log 2>&1)
  echo "PROF $1 rc $? at $(( $(date +%s)-t0 ))s"; grep -m1 "^selected" /root/logs/prof_$1.log
}
prof new $(pwd)
prof old /root/old
timeout 300 python3 scripts/tune_autotune.py --engine plain --trials 2 --install --json /root/pack/tune_plain.json \
  > /root/logs/tune_plain.log 2>&1
echo "TUNE rc $? at $(( $(date +%s)-t0 ))s"; tail -4 /root/logs/tune_plain.log
find /root/sj/jax-cache/xla_gpu_per_fusion_autotune_cache_dir -type f | head -3
echo ALLDONE
