#!/bin/bash
# An A/B of host-bound GPU figures on one machine: an earlier commit against this tree, taking turns
# (base, head, base, head), since a GPU machine's host speed drifts within minutes and differs
# between machines (benchmarks/README.md). Two steps:
#
#   here (a git checkout):   bash benchmarks/gpu_ab.sh prepare <commit>   # writes .bench/base (ignored)
#   on the GPU machine:      bash benchmarks/gpu_ab.sh run                # carry .bench (and .whl)
#
# `run` times the demo's RL stage (--rl-steps, median split of its steps after the first 10) and
# gpu_step.py's plan-sized GRPO step for each side; one JSON line per side and turn in $OUT/ab.jsonl
# (STEPS, TURNS, DEMO_TIMEOUT and GRPO_TIMEOUT change the defaults 150, 2, 60 and 45; on a CPU the
# GRPO step needs no SmolLM2 tokenizer in .bench: its small model has the character vocabulary).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
prepare)
    rm -rf "$here/.bench/base" && mkdir -p "$here/.bench/base"
    git -C "$here" archive "${2:?a commit to compare with}" posttrain benchmarks | tar -x -C "$here/.bench/base"
    git -C "$here" rev-parse --short "$2" > "$here/.bench/base/COMMIT"
    if [ ! -d "$here/.bench/smollm2-tokenizer" ]; then  # SmolLM2's tokenizer for the GRPO step, from the wheel's GGUF
        "$here/.venv/bin/python" -c "from posttrain.models.gguf import smollm2_gguf_path as p, load_gguf_tokenizer as t; \
t(p()).save_pretrained('$here/.bench/smollm2-tokenizer')" || echo "no SmolLM2 tokenizer: the GRPO step runs on the character tokenizer"
    fi
    echo "base $(cat "$here/.bench/base/COMMIT") in .bench/base; head is the working tree" ;;
run)
    out=${OUT:-/tmp/gpu_ab}; steps=${STEPS:-150}; mkdir -p "$out"
    if [ -d "$here/.whl" ] && [ "${INSTALL_WHEELS:-1}" = 1 ]; then  # the packages the GPU image lacks (device README)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/.whl/*.whl || exit 1
    fi
    export PYTHONUNBUFFERED=1
    tokenizer=(); [ -d "$here/.bench/smollm2-tokenizer" ] && tokenizer=(--tokenizer "$here/.bench/smollm2-tokenizer")
    for turn in $(seq "${TURNS:-2}"); do
        for side in base head; do
            root=$here; [ "$side" = base ] && root=$here/.bench/base
            rm -rf "/tmp/ab_demo_$side"
            PYTHONPATH=/tmp/site:$root timeout "${DEMO_TIMEOUT:-60}" python3 -m posttrain demo \
                --output-dir "/tmp/ab_demo_$side" --rl-steps "$steps" --no-baseline > "/tmp/ab_demo_$side.log" 2>&1
            python3 - "$side" "$turn" "/tmp/ab_demo_$side/rl/metrics.jsonl" <<'PY' | tee -a "$out/ab.jsonl"
import json, statistics, sys
side, turn, path = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open(path) if '"time/step_s"' in line][10:]
except OSError as error:
    rows, why = [], str(error)
keys = sorted({k for r in rows for k in r if k.startswith("time/")})
ms = {k: round(statistics.median(r[k] for r in rows if k in r) * 1e3, 2) for k in keys}
print(json.dumps({"case": "demo_rl_step_ms", "side": side, "turn": int(turn), "steps": len(rows), **ms}))
PY
            (cd "$root" && PYTHONPATH=/tmp/site:$root timeout "${GRPO_TIMEOUT:-45}" python3 benchmarks/gpu_step.py \
                --cases grpo --grpo-variants graphs "${tokenizer[@]}" 2>&1 \
                | grep '"grpo"' | sed "s/^{/{\"side\": \"$side\", \"turn\": $turn, /" | tee -a "$out/ab.jsonl")
        done
    done ;;
*)
    sed -n '2,12p' "$0"; exit 2 ;;
esac
