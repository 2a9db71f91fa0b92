# session 48: the Mosaic verify kernel that writes its tokens' K / V (fixed: pages read once, shared row
# writes), on ($SPECJAX_FUSE_KV_WRITE=1) against off (=0) on the same code: GPU tests, profiles, eval pairs
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
M=/root/sj/smollm2-135m-instruct
mkdir -p /root/pack /root/logs; t0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU $GPU"; git log --oneline -1 2>/dev/null
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention_kernels.py -k "on_gpu or write" > /root/logs/gputest.log 2>&1
echo "GPUTEST rc $? at $(( $(date +%s)-t0 ))s"; tail -3 /root/logs/gputest.log
E="eval --limit 10 --max-tokens 256 --max-batch 1 --min-accept none --repeats 2"
ev() {  # name fuse
  SPECJAX_FUSE_KV_WRITE=$2 timeout 420 python3 -m specjax.cli $E --json /root/pack/$1.json > /root/logs/$1.log 2>&1
  echo "EVAL $1 rc $? at $(( $(date +%s)-t0 ))s"; python3 .devcarry/jobs/summ.py /root/pack/$1.json | tail -2
}
prof() {  # name fuse
  SPECJAX_FUSE_KV_WRITE=$2 timeout 240 python3 scripts/profile_step.py --max-tokens 128 --ops 700 \
     --json /root/pack/prof_$1.json > /root/logs/prof_$1.log 2>&1
  echo "PROF $1 rc $? at $(( $(date +%s)-t0 ))s"; grep -m2 -i "kernels" /root/logs/prof_$1.log
}
prof on 1
prof off 0
echo PROFDONE
ev on1 1
ev off1 0
echo PART1DONE
ev off2 0
ev on2 1
(cd /root && tar czf /root/pack/logs48.tgz logs)
echo ALLDONE
