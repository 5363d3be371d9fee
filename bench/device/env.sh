# Sourced by every device script: the packages installed by install_target.sh and the peagle home live in ~/keep.
export PYTHONUNBUFFERED=1 PEAGLE_HOME=~/keep/peagle PEAGLE_KEEP=~/keep
case ":${PYTHONPATH:-}:" in *":$HOME/keep/site:"*) ;; *) if [ -d ~/keep/site ]; then export PYTHONPATH=~/keep/site${PYTHONPATH:+:$PYTHONPATH}; fi ;; esac
mkdir -p "$OUT/r"
# Only what this call wrote comes back (a call returns at most 8 files): JSONs newer than the call's first sourcing
# of this file (not than $OUT/r, whose time moves whenever a script copies a file into it).
export PEAGLE_CALL_T0=${PEAGLE_CALL_T0:-$(date +%s)}
save() { find bench/results ~/keep -maxdepth 1 -name '*.json' -newermt "@$PEAGLE_CALL_T0" -exec cp {} "$OUT/r/" \; 2>/dev/null || true; }
