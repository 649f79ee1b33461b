#!/usr/bin/env bash
# benchmarks/vllm_gpu.sh: python -m benchmarks.vllm on a machine with an NVIDIA GPU and the CUDA build of vLLM.
#
# The same comparison as on a CPU (plain vLLM, the switch on with no policy, 1, 2 and 4 policies; eager and
# compiled; offline and vllm serve), with the engines sized for a GPU (--device cuda: 0.3 of its memory each, two
# engines up at once). "compiled" is vLLM's default on a GPU: torch.compile and piecewise CUDA graphs, captured at
# start-up for the batch sizes vLLM pads to; "eager" is --enforce-eager (no graphs). Written without a GPU at hand:
# read it before running it.
#
#   bash benchmarks/vllm_gpu.sh                   # a venv of its own in .ci/venv-vllm-cuda, then both runs
#   VENV=/path/to/venv bash benchmarks/vllm_gpu.sh --rounds 3    # an existing venv with vllm; extra flags go on
#
# What to check first in the output:
# - "answers checked ... mismatches": float32 (the first run) should give none. A mismatch in the plain vLLM arm
#   too is vLLM's own batch variance (cuBLAS picks its GEMM by batch size), not kernelpolicy; one only in the
#   policy arms is a row that took another path than its request's.
# - compiled, "switch on, no policy" against plain: with the switch on, a compiled step computes both paths of each
#   op with a kernel, also with no policy in the step (docs/vllm.md); on a GPU every CustomOp with a forward_cuda
#   and the IR ops with the vllm_c provider have one, so expect this arm well below 0.99x.
# - whether CUDA graphs were captured in both engines of the compiled blocks: "Capturing CUDA graphs" in the logs
#   ($LOGS/<dtype>/<mode>-<way>-{plain,switch-on}.log; a failing engine also prints its log's tail).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.ci/venv-vllm-cuda}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm==0.33.0"  # the CUDA build, with the torch it pins (0.34: not supported yet)
    "$VENV/bin/pip" install -q -e .                # kernelpolicy, whose entry point vLLM loads as a plugin
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# kernelpolicy follows vLLM's V1 model runner and refuses the V2 one (vLLM's default on a GPU): both arms run V1
export VLLM_USE_V2_MODEL_RUNNER=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python -m kernelpolicy doctor || true  # what kernelpolicy finds here; the benchmark runs either way

# A Llama of 16 layers, hidden 2048 (random weights, about 3 GB in float32): a GPU step of the CPU's 512 x 4 would be
# all launch overhead. 32 requests of 128 tokens per arm, 32 client streams online.
LOAD=(--device cuda --hidden 2048 --layers 16 --rounds 5 --requests 32 --streams 32 --tokens 128)
LOGS=${LOGS:-benchmarks/results/vllm-gpu}  # each engine's log, kept (benchmarks/results/ is git-ignored)
status=0
# float32: the tokens check holds (each answer equal to its request alone). FlashAttention takes no float32: vLLM
# should choose another attention backend by itself (its log names the one it chose).
python -m benchmarks.vllm "${LOAD[@]}" --dtype float32 --logs "$LOGS/float32" "$@" || status=$?
# bfloat16, the dtype a GPU deployment runs: the numbers that matter; mismatches here may be batch variance (above).
python -m benchmarks.vllm "${LOAD[@]}" --dtype bfloat16 --logs "$LOGS/bfloat16" "$@" || status=$?
exit "$status"
