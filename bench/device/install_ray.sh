# Sourced by the scripts that carry .carry/ray (bench/device/prepare_ray.sh), after env.sh: Ray 2.60 unpacked
# into ~/keep/site (once per warm machine) and, through pip, only the carried runtime needs this image lacks or
# has too old (~/keep/rdeps); both put on PYTHONPATH.
mkdir -p ~/keep/site
[ -d ~/keep/site/ray ] || tar -C ~/keep/site -xJf .carry/ray/ray-2.60.0-cp312.tar.xz
python3 -m pip install -q --no-index --no-compile --find-links .carry/ray/wheels --prefix ~/keep/rdeps \
  click msgpack protobuf jsonschema pydantic 2>&1 | grep -v "^\[notice\]"
RDEPS=$(find ~/keep/rdeps -maxdepth 4 -type d \( -name site-packages -o -name dist-packages \) 2>/dev/null | head -1)
export PYTHONPATH=~/keep/site${RDEPS:+:$RDEPS}${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0
