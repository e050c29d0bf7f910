#!/usr/bin/env bash
# One call on a lent Hopper machine: the steps of `python -m w4a4_book.checks` named on the command line, in order,
# each given at most its cap and never more than what is left of the call's budget; their records and logs go to OUT.
# Run it from the checkout's root, so that `python3 -m` imports this checkout's package.
#   bash tools/gpu_batch.sh OUT BUDGET_S suite sanitize diagnose moves ladder flux1024 flux512
set -uo pipefail
out=${1:?an output folder}; end=$(( $(date +%s) + ${2:?a budget in seconds} )); shift 2
declare -A cap=([suite]=330 [sanitize]=150 [diagnose]=90 [moves]=420 [ladder]=240 [flux1024]=570 [flux512]=570)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
for step in "$@"; do
    left=$(( end - $(date +%s) )); t=$(( left < ${cap[$step]} ? left : ${cap[$step]} ))
    [ "$t" -gt 20 ] || { echo "$step: no time left"; continue; }
    echo "== $step (at most $t s)"
    case $step in
        suite) timeout "$t" python3 -m w4a4_book.checks suite --out "$out/gpu_suite_$gpu.json" --workers 14 ;;
        sanitize) timeout "$t" python3 -m w4a4_book.checks sanitize --out "$out/sanitizer_$gpu.json" --workers 8 ;;
        diagnose) timeout "$t" python3 -m w4a4_book.checks diagnose --out "$out/diagnose_$gpu.json" ;;
        moves|ladder) timeout "$t" python3 -m w4a4_book.checks records --out-dir "$out" --only "$step" ;;
        flux*) timeout "$t" python3 -c 'import sys; from w4a4_book.cli import main; sys.exit(main(sys.argv[1:]))' \
                   bench-flux --res "${step#flux}" --out "$out/flux_${gpu}_${step#flux}.json" ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac 2>&1 | tee "$out/$step.log"
done
