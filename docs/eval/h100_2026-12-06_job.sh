# session 47: the verify kernel that writes its tokens' K / V (no scatter per layer: 539 -> 509 kernels
# compile-only). (0) the kernel compiled on this GPU against write_kv + the reference; (1) profile old / new;
# (2) eval pairs old / new on one machine (old = 0a882cd, rebuilt from .devcarry/exp/s48_write.diff)
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
M=/root/sj/smollm2-135m-instruct
mkdir -p /root/pack /root/logs; t0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU $GPU"
rm -rf /root/old && cp -r . /root/old && (cd /root/old && (patch -R -p1 -s < .devcarry/exp/s48_write.diff || git apply -R .devcarry/exp/s48_write.diff)) && echo "OLD tree ok"
grep -c write_and_attend /root/old/specjax/models/llama.py specjax/models/llama.py
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention_kernels.py -k "on_gpu or write" > /root/logs/gputest.log 2>&1
echo "GPUTEST rc $? at $(( $(date +%s)-t0 ))s"; tail -3 /root/logs/gputest.log
E="eval --limit 10 --max-tokens 256 --max-batch 1 --min-accept none --repeats 2"
ev() {  # name dir
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 400 python3 -m specjax.cli $E --json /root/pack/$1.json > /root/logs/$1.log 2>&1)
  echo "EVAL $1 rc $? at $(( $(date +%s)-t0 ))s"; python3 .devcarry/jobs/summ.py /root/pack/$1.json | tail -1
}
prof() {  # name dir
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 240 python3 scripts/profile_step.py --max-tokens 128 --ops 700 \
     --json /root/pack/prof_$1.json > /root/logs/prof_$1.log 2>&1)
  echo "PROF $1 rc $? at $(( $(date +%s)-t0 ))s"; grep -m2 -i "kernels" /root/logs/prof_$1.log
}
prof new $(pwd)
prof old /root/old
echo PROFDONE
ev new1 $(pwd)
ev old1 /root/old
echo PART1DONE
ev old2 /root/old
ev new2 $(pwd)
(cd /root && tar czf /root/pack/logs48.tgz logs)
echo ALLDONE
