# session 49b: the GEMM autotuner's picks: fused and plain step profiles with autotuning off (level 0) and default
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
mkdir -p /root/pack /root/logs; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
prof() {  # name xla_flags args...
  n=$1; fl=$2; shift 2
  XLA_FLAGS="$fl" timeout 200 python3 scripts/profile_step.py --ops 40 --max-tokens 128 --json /root/pack/prof_$n.json "$@" > /root/logs/prof_$n.log 2>&1
  echo "PROF $n rc $? at $(( $(date +%s)-t0 ))s"; grep -m1 "^selected" /root/logs/prof_$n.log; grep "dot_general" /root/logs/prof_$n.log | grep -v draft | head -6
}
prof fused_l0 "--xla_gpu_autotune_level=0"
prof plain_l0 "--xla_gpu_autotune_level=0" --draft none
prof plain_def "" --draft none
echo ALLDONE
