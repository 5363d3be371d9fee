#!/usr/bin/env bash
# Keep the files and folders (e.g. a head for training.init_from) of each carried folder given ("$@", e.g.
# .carry/v1) in ~/keep for the next calls on the same warm machine (a machine idle for ~30 s goes back, ~/keep
# with it); print the GPU and what ~/keep holds.
set -u
mkdir -p ~/keep && for d in "$@"; do cp -r "$d"/* ~/keep/; done
nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,utilization.gpu --format=csv
du -sh ~/keep; ls ~/keep
