#!/usr/bin/env bash
# Carry .carry/ray (bench/device/prepare_ray.sh), kind nvidia-h200-x2. Ray Train DDP scaling of
# P-EAGLE training, 1 vs 2 GPUs (bench.ddp_scaling). One call, < 500 s.
#
# Installs into ~/keep (kept while the machine stays warm): Ray 2.60 unpacked into ~/keep/site,
# and through pip only the carried runtime needs this image lacks or has too old (~/keep/rdeps).
# If `import ray.train` still fails (ray.train imports pandas and pyarrow, which are not carried),
# the same benchmark runs with --launcher torch (torch.multiprocessing + DDP) and says so.
set -u
T0=$SECONDS
mkdir -p "$OUT/r"
. bench/device/env.sh
. bench/device/install_ray.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import pandas, pyarrow; print('pandas', pandas.__version__, 'pyarrow', pyarrow.__version__)"
LAUNCHER=ray
python3 -c "import ray, ray.train, ray.train.torch; print('ray', ray.__version__, ray.__file__)" || LAUNCHER=torch
set -o pipefail
timeout $((480 - (SECONDS - T0))) python3 -m bench.ddp_scaling --launcher $LAUNCHER 2>&1 |
  grep -v "Failed to query Ray Train Controller" | tee "$OUT/ddp_scaling.log" | cut -c1-300
rc=$?; echo "ddp_scaling ($LAUNCHER) rc=$rc after $((SECONDS - T0)) s"
if [ $rc -ne 0 ] && [ $LAUNCHER = ray ] && [ $((SECONDS - T0)) -lt 240 ]; then
  echo "Ray Train run failed: the same benchmark with --launcher torch"
  timeout $((480 - (SECONDS - T0))) python3 -m bench.ddp_scaling --launcher torch 2>&1 |
    tee "$OUT/ddp_scaling_torch.log" | cut -c1-300
  echo "ddp_scaling (torch) rc=$? after $((SECONDS - T0)) s"
fi
cp bench/results/ddp_scaling.json "$OUT/r/" 2>/dev/null; ls -la "$OUT/r"
