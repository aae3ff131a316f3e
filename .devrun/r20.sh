source .devrun/common.sh
BUDGET=570
for m in 1 4 15; do LOGITSERVE_STREAMED=$m step kernels_m$m 90 $B/cuda_kernels_test; done
LOGITSERVE_STREAMED=1 step backend_m1 150 $B/cuda_backend_test
LOGITSERVE_STREAMED=5 step determinism_m5 90 $B/cuda_backend_determinism_test
for m in 0 1 17; do LOGITSERVE_STREAMED=$m step hid_m$m 60 $B/logitserve-kernel-bench --no-logits --hidden-iters 3; done
for m in 0 5 7; do LOGITSERVE_STREAMED=$m step log_m$m 60 $B/logitserve-kernel-bench --no-hidden --iters 10 --dtypes bf16,fp32; done
LOGITSERVE_STREAMED=1 step ncu_hid 90 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats -k regex:StreamedKernel -s 20 -c 2 $B/logitserve-kernel-bench --no-logits --hidden-iters 1 --hidden-rows 1024
finish
