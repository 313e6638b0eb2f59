# Source ON the GPU machine (from the repo root, .devcarry/base carried): installs the staged TVM
# runtime (../shared/device/stage.sh made it here), puts it first on the path and makes the working
# tree importable as the package `moec` without installing anything.
bash .devcarry/base/install.sh "$@" && source .devcarry/base/env.sh || return 1
mkdir -p /tmp/moec-pkg && ln -sfn "$PWD" /tmp/moec-pkg/moec
export PYTHONPATH="/tmp/moec-pkg:$PYTHONPATH" PYTHONUNBUFFERED=1
