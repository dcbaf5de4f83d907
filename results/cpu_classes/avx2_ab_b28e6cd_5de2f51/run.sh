#!/bin/bash
# Interleaved A/B under the AVX2 limit, float32: b28e6cd (A) against this checkout (B), HF generate (C).
# Run from the repository root after: git worktree add --detach ../ab28 b28e6cd &&
#   pip install --no-deps --target ../ab28_site ../ab28     (b28e6cd's package beside this one's)
# HEADS: an absolute path to a checkpoint both versions read (the run used the Hydra shipped at d04b8d6).
set -e
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
D=results/cpu_classes/avx2_ab_b28e6cd_5de2f51; HEADS=${HEADS:?a checkpoint directory}
for r in 1 2 3 4 5; do
  [ $r -ge 4 ] && python $D/hf.py | grep RESULT | sed "s/^RESULT/C $r hf/" >> $D/results.txt
  # each version keeps its own cache, so each calibrates once (rep 1) and reuses it
  (cd /tmp && PYTHONPATH=$OLDPWD/../ab28_site DRAFTHEADS_CACHE=$OLDPWD/$D/cache_A python $OLDPWD/$D/ab.py $HEADS default) | grep RESULT | sed "s/^RESULT/A $r default/" >> $D/results.txt
  DRAFTHEADS_CACHE=$D/cache_B python $D/ab.py $HEADS default | grep RESULT | sed "s/^RESULT/B $r default/" >> $D/results.txt
done
# results.json: these lines as records (arm, rep, tokens/s, steps, ms a step, mean tree nodes)
