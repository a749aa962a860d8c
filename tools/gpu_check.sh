#!/usr/bin/env bash
# leapfx on one CUDA GPU, as one command: the gpu-marked tests, manual CUDA graphs against
# Inductor's graph trees, then the benches docs/gpu.md quotes. Installs nothing: it runs on the
# machine's own torch, transformers and Triton, with this checkout on PYTHONPATH.
#
#   tools/gpu_check.sh [OUT_DIR] [STEPS]     (OUT_DIR default: gpu-check; STEPS default: all)
#
# STEPS is a comma-separated subset of: tests, graphs, random, reference, batch. Each step has
# its own time limit and writes its log (and the benches' JSON) to OUT_DIR; a step that fails or
# runs out of time does not stop the next. All five take longer than one device call allows
# (10 minutes), Inductor compiling from scratch on a fresh machine: run them as two calls,
#   tools/gpu_check.sh "$OUT" tests,random,graphs     (about 6 minutes)
#   tools/gpu_check.sh "$OUT" reference,batch         (about 9 minutes)
# The benches show progress on stderr (in their logs), so a step cut short says where it was.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
steps="${2:-tests,graphs,random,reference,batch}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
leapfx=(python -m leapfx.cli)

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a limit, its output to NAME.log
  local name=$1 limit=$2
  shift 2
  case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tr '\r' '\n' \
    | grep -v -E "^\s*$|Warning|warn\(|DEBUG|it/s\]" | tail -60
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import sys, torch, transformers, triton; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers',
transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/versions.txt"

gpu_tests=$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
step tests 170 python -m pytest -q -p no:cacheprovider -m gpu -n 8 -rs $gpu_tests
step graphs 150 python tools/gpu_graphs.py --size 0.5b --modes manual,trees --tokens 128 \
  --repeats 2 --json "$out/graphs.json"
step random 130 "${leapfx[@]}" bench --random-model 0.5b --device cuda --dtype bfloat16 \
  --backend eager,inductor --prompts 2 --max-new-tokens 128 --repeats 1 --progress \
  --json "$out/random.json"
step reference 330 "${leapfx[@]}" bench --device cuda --recipe layerskip,kangaroo,eagle \
  --backend inductor --prompts 3 --max-new-tokens 128 --repeats 1 --progress \
  --json "$out/reference.json"
step batch 240 "${leapfx[@]}" bench --device cuda --batch-size 1,4,8 --backend inductor \
  --recipe layerskip,lookup --prompts 8 --max-new-tokens 64 --repeats 1 --progress \
  --json "$out/batch.json"
