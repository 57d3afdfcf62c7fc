#!/usr/bin/env bash
# The A/B driver of h100_product_variants.json: run from the repository root on the GPU machine,
# with the switches of h100_product_variants.patch applied.
# usage: results/dev/h100_product_variants.sh "SHAPES" NAME=ENV... ; ENV is "VAR=val;VAR=val" (empty: defaults)
# One roofline process per variant; prints each product step and fwd+bwd per shape.
export PYTHONUNBUFFERED=1
shapes=$1; shift
for v in "$@"; do
  name=${v%%=*}; envs=${v#*=}
  out=${OUT:-/tmp}/v_$name
  start=$(date +%s)
  ( IFS=';'; for kv in $envs; do [ -n "$kv" ] && export "$kv"; done; IFS=' '
    python -m experiments.roofline --shapes $shapes --repeats 10 --out "$out" > "$out.log" 2>&1 ) \
    || { echo "$name FAILED"; tail -5 "$out.log"; continue; }
  python - "$name" "$out/roofline.json" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
steps = {}
for r in d["rows"]:
    steps.setdefault(r["shape"], {})[r["step"]] = r["ms"]
for s in d["summary"]:
    st = steps[s["shape"]]
    pick = lambda k: next((v for n, v in st.items() if n.startswith(k)), float("nan"))
    print(f"{sys.argv[1]:10s} {s['shape'][:18]:18s} fwdbwd {s['fwd+bwd ms']:6.2f} dE {pick('product dE'):6.2f} "
          f"dC {pick('product dC'):6.2f} rec1 {pick('recompute by grid'):5.2f} rec2 {pick('recompute by lists'):5.2f} ({sys.argv[3]}s)")
PY
done
