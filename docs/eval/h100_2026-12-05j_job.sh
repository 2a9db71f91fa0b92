# session 47+: (1) A/B on one machine: the fused step's 20 fewer kernels (session 46: clip gathers and shared
# bounds in the draft tree, packed loop outputs and hand-over carry) against the code before (991a152,
# rebuilt here from the patch in .devcarry/exp/s46_kernels.diff): eval pair + profile pair; (2) float32
# lossless of the new code on the GPU; then (3) s46a's one-slot repro (optional)
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
M=/root/sj/smollm2-135m-instruct
mkdir -p /root/pack /root/logs; t0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU $GPU"
rm -rf /root/old && cp -r . /root/old && (cd /root/old && (patch -R -p1 -s < .devcarry/exp/s46_kernels.diff || git apply -R .devcarry/exp/s46_kernels.diff)) && echo "OLD tree ok"
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
prof old /root/old
prof new $(pwd)
echo PROFDONE
ev new1 $(pwd)
ev old1 /root/old
echo PART1DONE
ev old2 /root/old
ev new2 $(pwd)
timeout 300 python3 scripts/check_lossless.py --model $M --variants new --json /root/pack/chk_new.json > /root/logs/chk_new.log 2>&1
echo "CHECK new rc $? at $(( $(date +%s)-t0 ))s"; grep RESULT /root/logs/chk_new.log
(cd /root && tar czf /root/pack/logs47.tgz logs)
echo ALLDONE
