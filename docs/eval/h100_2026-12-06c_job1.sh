# session 49: where a long (sum) request's extra spec time goes: prefill vs step at long context
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
mkdir -p /root/pack /root/logs; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
ro() {  # name args...
  n=$1; shift
  timeout 420 python3 scripts/probe_request_overhead.py --prompts 10 --lengths 128,256 --reps 2 \
     --sets "sum;mt_bench" --max-chars 0 --json /root/pack/ro_$n.json "$@" > /root/logs/ro_$n.log 2>&1
  echo "RO $n rc $? at $(( $(date +%s)-t0 ))s"; grep -v -i warn /root/logs/ro_$n.log | grep -v "^I0000\|absl" | tail -12
}
ro plain --no-spec
ro spec --no-plain
echo RODONE
prof() {  # name args...
  n=$1; shift
  timeout 300 python3 scripts/profile_step.py --prompt-set sum --ops 60 --json /root/pack/prof_$n.json "$@" > /root/logs/prof_$n.log 2>&1
  echo "PROF $n rc $? at $(( $(date +%s)-t0 ))s"; grep -A12 "^== batch" /root/logs/prof_$n.log | head -16
}
prof spec_prefill --module-re prefill --max-tokens 64
prof plain_prefill --module-re prefill --max-tokens 64 --draft none
prof spec_long --max-tokens 128
echo ALLDONE
