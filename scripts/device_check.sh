#!/usr/bin/env bash
# The GPU checks of docs/device.md in one command, for a lent GPU machine whose image has torch,
# triton and transformers but not msgspec, pyzmq, gguf or xgrammar: those travel as wheels in
# .whl/ (docs/device.md says how to fetch them).
#
#   bash scripts/device_check.sh [tests|tier] [bench] [bench-long] [moe] [profile] [gguf] [serve]
#                                [quant] [spec]
#   (default: tests bench profile)
#
# Figures and logs go to $OUT (or ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
stages=${*:-tests bench profile}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
# No `git log` here: a copied tree may carry a stale .git; name the commit you sent yourself.
rc=0
for stage in $stages; do
    echo "=== $stage"
    start=$(date +%s)
    case $stage in
    tests)
        # The CUDA tier, the Triton kernels compiled for the device (tests/kernels: the int
        # GEMM, FP8 W8A8 on cc >= 8.9), the graph tests, GGUF models (mixed; int types).
        python3 -m pytest -q -p no:cacheprovider tests/worker/test_cuda_tier.py \
            tests/worker/test_cuda_graphs.py tests/worker/test_gguf_model.py tests/kernels \
            tests/worker/test_gguf_int_model.py tests/worker/test_quantized_checkpoints_triton.py \
            tests/bench/test_device.py tests/worker/test_fused_fp8_norm.py \
            2>&1 | tee "$OUT/tests.log" | tail -25 || rc=1
        ;;
    bench)
        # Batch 1 and 64 at a short context, graphs on and off, async scheduling on and off.
        python3 -m serve.cli bench device --batch-sizes 1,64 --output-json "$OUT/bench.json" \
            2>"$OUT/bench.err" | tail -60 || rc=1
        tail -5 "$OUT/bench.err"
        ;;
    bench-long)
        # Batch 1 at a 32k context: the split-context decode.
        python3 -m serve.cli bench device --batch-sizes 1 --context-len 32k --output-len 32 \
            --output-json "$OUT/bench_32k.json" 2>"$OUT/bench_32k.err" | tail -40 || rc=1
        tail -5 "$OUT/bench_32k.err"
        ;;
    moe)
        # Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8; 61 GB of dummy bf16 weights):
        # batch 1 and 64, graphs and async on (--quick: one engine), the experts each step
        # reads counted from its routing (docs/device.md).
        python3 -m serve.cli bench device --shape qwen3-30b-a3b --quick --batch-sizes 1,64 \
            --context-len 128 --output-len 32 --output-json "$OUT/bench_moe.json" \
            2>"$OUT/bench_moe.err" | tail -40 || rc=1
        tail -5 "$OUT/bench_moe.err"
        ;;
    gguf)
        # The Triton GGUF matmul on the 8B shape's projections against bf16 cuBLAS.
        python3 scripts/bench_gguf_matmul.py 2>"$OUT/gguf.err" | tee "$OUT/gguf.json" || rc=1
        # The int GEMM (int4 g128, int8, Q4_K's layout) and FP8 (W8A8, weight-only) the same way,
        # each step's ratio to bf16 at the same rows.
        python3 scripts/bench_int_matmul.py 2>>"$OUT/gguf.err" | tee "$OUT/int_matmul.json" || rc=1
        # The whole 8B shape in Q4_K (a 4.5 GB random GGUF written on the machine).
        python3 -m serve.cli bench device --gguf-type Q4_K --batch-sizes 1,64 \
            --output-json "$OUT/bench_q4k.json" 2>>"$OUT/gguf.err" | tail -60 || rc=1
        tail -5 "$OUT/gguf.err"
        ;;
    serve)
        # engine serve end to end: the 8B shape with dummy weights and the default model's
        # tokenizer files from .devmodel/ (docs/device.md).
        python3 scripts/device_serve_check.py --tokenizer-dir .devmodel \
            2>"$OUT/serve.err" | tee "$OUT/serve.json" || rc=1
        tail -5 "$OUT/serve.err"
        ;;
    quant)
        # Issue 32 on this card: the quantized methods against the dequantized dense model
        # (scripts/device_quant_check.py), the 8B shape's quantized weights against bf16 at
        # batch 1, 16 and 64, and the fp8 KV cache against bf16's at a 32k context, batch 1,
        # on bf16 and on fp8 weights; graphs and async on. One JSON ($OUT/quant.json) and one
        # log ($OUT/quant.err).
        tmp=$(mktemp -d)
        python3 scripts/device_quant_check.py >"$tmp/check.json" 2>>"$OUT/quant.err" || rc=1
        python3 -m serve.cli bench device --quick --batch-sizes 1,16,64 --output-len 32 \
            --quantization fp8,gptq,awq,gguf-Q4_K --output-json "$tmp/weights.json" \
            >/dev/null 2>>"$OUT/quant.err" || rc=1
        python3 -m serve.cli bench device --quick --batch-sizes 1 --context-len 32k \
            --output-len 32 --kv-cache-dtype fp8 --quantization fp8 \
            --output-json "$tmp/kv_cache.json" \
            >/dev/null 2>>"$OUT/quant.err" || rc=1
        python3 - "$tmp" "$OUT/quant.json" <<'PY'
import json, sys
from pathlib import Path
tmp, out = Path(sys.argv[1]), sys.argv[2]
merged = {}
for part in ("check", "weights", "kv_cache"):
    path = tmp / f"{part}.json"
    merged[part] = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else None
Path(out).write_text(json.dumps(merged, indent=2) + "\n")
for case in (merged["check"] or {}).get("cases", []):
    print("check", case["quantization"], case["dtype"], "ok" if case["ok"] else "FAILED",
          case.get("max_logprob_diff", case.get("error")))
for part in ("weights", "kv_cache"):
    result = merged[part] or {}
    base = {r["batch_size"]: r["ms_per_step"] for r in result.get("runs", [])}
    print(part, "baseline ms", base)
    for v in result.get("variants", []):
        if "error" in v:
            print(" ", v["name"], "FAILED", v["error"])
            continue
        ratios = {r["batch_size"]: r["ms_ratio_to_baseline"] for r in v["runs"]}
        same = {r["batch_size"]: r.get("ms_ratio_to_same_weights") for r in v["runs"]}
        unmet = [t["target"] for t in v["targets"] if not t["met"]]
        print(" ", v["name"], "ratio", ratios, "to same weights" if v["kv_cache_dtype"] != "auto"
              else "", same if v["kv_cache_dtype"] != "auto" else "", "unmet:", unmet or "none")
PY
        rm -rf "$tmp"
        tail -5 "$OUT/quant.err"
        ;;
    spec)
        # Issue 33: the 8B shape at batch 1, dummy weights, the editing workload's shape: no
        # speculation, n-gram, and a Llama-3.2-1B-shaped dummy draft model, one engine after
        # the other (scripts/device_spec_check.py; $OUT/spec.json, log in $OUT/spec.err).
        python3 scripts/device_spec_check.py 2>"$OUT/spec.err" >"$OUT/spec.json" || rc=1
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
for n in ('baseline', 'ngram', 'draft_model'):
    print(n, {k: r[n].get(k) for k in ('decode_tok_s', 'ms_per_step', 'tokens_per_step',
          'mean_acceptance_length', 'acceptance_rate', 'greedy_tokens_identical', 'error')})
print('targets', r.get('targets'))" "$OUT/spec.json"
        tail -5 "$OUT/spec.err"
        ;;
    profile)
        for eager in "" --enforce-eager; do
            python3 scripts/profile_decode_step.py --batch 1 $eager \
                2>>"$OUT/profile.err" | tee -a "$OUT/profile.json" || rc=1
        done
        tail -5 "$OUT/profile.err"
        ;;
    tier)
        # The CUDA tier and the graph tests alone (no kernel tests): a quicker check.
        python3 -m pytest -q -p no:cacheprovider tests/worker/test_cuda_tier.py \
            tests/worker/test_cuda_graphs.py tests/bench/test_device.py \
            2>&1 | tee "$OUT/tier.log" | tail -25 || rc=1
        ;;
    *)
        echo "unknown stage $stage" >&2
        rc=2
        ;;
    esac
    echo "=== $stage took $(($(date +%s) - start)) s"
done
exit $rc
