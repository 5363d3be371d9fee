# Sourced by every device script: the packages installed by install_target.sh and the peagle home live in ~/keep.
export PYTHONUNBUFFERED=1 PEAGLE_HOME=~/keep/peagle PEAGLE_KEEP=~/keep
case ":${PYTHONPATH:-}:" in *":$HOME/keep/site:"*) ;; *) if [ -d ~/keep/site ]; then export PYTHONPATH=~/keep/site${PYTHONPATH:+:$PYTHONPATH}; fi ;; esac
mkdir -p "$OUT/r"
# Only what this call wrote comes back (a call returns at most 8 files): JSONs newer than the call's first sourcing
# of this file (not than $OUT/r, whose time moves whenever a script copies a file into it).
export PEAGLE_CALL_T0=${PEAGLE_CALL_T0:-$(date +%s)}
save() { find bench/results ~/keep -maxdepth 1 -name '*.json' -newermt "@$PEAGLE_CALL_T0" -exec cp {} "$OUT/r/" \; 2>/dev/null || true; }
# keep_install PREFIX WHEEL_DIR PIP_ARGS...: pip-installs PIP_ARGS (names, or -r FILE) from the carried wheels in
# WHEEL_DIR into the prefix PREFIX, only what the image and PYTHONPATH (~/keep) lack or have too old: pip resolves
# first (--dry-run --report), then installs exactly that list --no-deps --ignore-installed, so that the image's older
# copy stays (a plain --prefix install uninstalls it, and scripts that do not put ~/keep on PYTHONPATH lose it).
keep_install() {
  local prefix=$1 dir=$2 report pins; shift 2
  report=$(mktemp)
  python3 -m pip install -q --dry-run --no-index --find-links "$dir" --report "$report" "$@" 2>&1 |
    grep -v -E "^\[notice\]|is ignored"
  pins=$(python3 -c "import json, sys; print(' '.join(i['metadata']['name'] + '==' + i['metadata']['version'] for i in json.load(open(sys.argv[1]))['install']))" "$report") || { rm -f "$report"; return 1; }
  rm -f "$report"
  [ -z "$pins" ] && return 0
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --ignore-installed --no-compile --find-links "$dir" --prefix "$prefix" \
    $pins 2>&1 | grep -v -E "^\[notice\]|is ignored"
  return 0
}
