# Nsight Compute on cce's backward kernels at two shapes (run from the repository root on the GPU
# machine; writes to $OUT). Per shape: every kernel's time and grid (timeline), then the full
# sections of the first launch of each backward kernel. Committed as h100_backward_ncu_timeline.json
# (the timelines, condensed) and h100_backward_ncu_{gemma3,gemma2_2b}.txt (the sections).
set -x
for shape in gemma3 gemma2_2b; do
  ncu --clock-control none --profile-from-start off --csv \
      --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 results/dev/h100_backward_ncu.py $shape > $OUT/${shape}_timeline.csv 2> $OUT/${shape}_timeline.err
  for kernel in gradient_tiles_kernel sparse_tile_matmul_kernel classifier_product_kernel; do
    ncu --clock-control none --profile-from-start off --set detailed --page details \
        --kernel-name $kernel --launch-count 2 \
        python3 results/dev/h100_backward_ncu.py $shape >> $OUT/${shape}_detail.txt 2>&1
  done
done
