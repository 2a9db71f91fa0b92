# next GPU job (session 49+), for .devcarry/jobs/: the write kernel's own cost first (no model needed), then the
# step. (1) the compiled kernel against write_kv + the reference (now with the R-row boxes and write_at="start");
# (2) device kernel time per layer at the batch-1 verify shape: scatter / write_end / write_start / read_only;
# (3) only if a write_* variant takes less device time per layer than scatter (the probe counts the pack, pad and
# scatter kernels too): profiles on / off, then an eval pair;
# the profiles dump the GEMM autotuner's picks (two runs of the same code can differ: see the notes).
export SPECJAX_HOME=/root/sj PYTHONPATH=/tmp/site:$(pwd)
mkdir -p /root/pack /root/logs; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention_kernels.py -k "on_gpu or write" > /root/logs/gputest.log 2>&1
echo "GPUTEST rc $? at $(( $(date +%s)-t0 ))s"; tail -3 /root/logs/gputest.log
timeout 400 python3 scripts/probe_write_kernel.py --contexts 256,1024,2048 --reps 15 --json /root/pack/probe_write.json \
    > /root/logs/probe.log 2>&1
echo "PROBE rc $? at $(( $(date +%s)-t0 ))s"; grep -v -i warn /root/logs/probe.log | tail -14
echo PROBEDONE
prof() {  # name fuse; the GEMM autotuner's picks dumped (the verify MLP down GEMM took 94 or 110 us per step)
  XLA_FLAGS="--xla_gpu_dump_autotune_results_to=/root/pack/autotune_$1.txt" \
  SPECJAX_FUSE_KV_WRITE=$2 timeout 240 python3 scripts/profile_step.py --max-tokens 128 --ops 700 \
     --json /root/pack/prof_$1.json > /root/logs/prof_$1.log 2>&1
  echo "PROF $1 rc $? at $(( $(date +%s)-t0 ))s"; grep -m2 -i "kernels" /root/logs/prof_$1.log
}
prof on 1
prof off 0
echo ALLDONE
