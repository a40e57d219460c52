#!/bin/bash
# Hunting rare crashes of TP=2 runs over gloo (docs/reliability.md; the heap corruption it caught on 2026-12-05 was
# gloo's status-string race, worked around since, and tests/gloo_race_shim.c reproduces it): the README's main command
# (TP=2, 1 thread a rank), 600 steps a run, again and again until SECONDS have passed, in stream N (run two
# streams at once, as on 2026-12-05, for 4 ranks on 2 cores). Core dumps are on, so a rank that aborts or
# segfaults leaves a core, and gdb writes every thread's native stack beside it. Extra torchtitan flags
# (e.g. --comm.trace_buf_size 0) go after the two arguments.
# Usage, from the project venv: benchmarks/crash_loop.sh N SECONDS [flags...]   (logs, cores: /tmp/crash_loop/sN/)
set -u
n=$1; seconds=$2; shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
d=/tmp/crash_loop/s$n; mkdir -p $d/cwd && cd $d/cwd
for f in "$repo"/*; do ln -sfn "$f" .; done  # a core lands in the crashed process's working folder
ulimit -c unlimited
end=$(( $(date +%s) + seconds )); i=0
while [ "$(date +%s)" -lt $end ]; do
  i=$((i + 1)); rm -rf $d/dump
  OMP_NUM_THREADS=1 timeout 900 torchrun --standalone --nproc_per_node 2 -m torchtitan.train \
    --job.config_file train_configs/debug_cpu.toml --job.dump_folder $d/dump --training.steps 600 \
    --checkpoint.no-enable --metrics.log_freq 50 "$@" > $d/run_$i.log 2>&1
  rc=$?
  echo "$(date +%T) stream $n run $i rc=$rc $(grep -m1 -h 'malloc\|corrupt\|Fatal\|free()' $d/run_$i.log)"
  for core in $d/cwd/core*; do
    [ -e "$core" ] || continue
    gdb -batch -ex "info threads" -ex "thread apply all bt" "$(which python)" "$core" > $d/gdb_run_$i.txt 2>&1
    mv "$core" $d/core_run_$i; echo "  core: $d/core_run_$i, stacks: $d/gdb_run_$i.txt"
  done
done
