# Sourced by every call: the packages installed by call2 and the peagle home live in ~/keep.
export PYTHONUNBUFFERED=1 PEAGLE_HOME=~/keep/peagle PEAGLE_KEEP=~/keep
if [ -d ~/keep/site ]; then export PYTHONPATH=~/keep/site${PYTHONPATH:+:$PYTHONPATH}; fi
mkdir -p "$OUT/r"
save() { cp bench/results/*.json "$OUT/r/" 2>/dev/null || true; cp ~/keep/*.json "$OUT/r/" 2>/dev/null || true; }
