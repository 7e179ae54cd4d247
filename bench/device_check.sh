#!/usr/bin/env bash
# The device check (bench/device_check/__init__.py says what it checks), from a fresh copy of the tree:
#
#   bash bench/device_check.sh            # on the GPU machine: python3's CUDA torch, the wheels carried in .whl/
#   bash bench/device_check.sh --dry-run  # the same check on this CPU: the recording graph backend, torch's ops
#   bash bench/device_check.sh --prepare  # here, with PyPI: .whl/ and .device/model-shape/, both carried
#
# It writes device_check.json (the summary), device_check.log (its output) and stack-logs.tar.gz (every process's
# log) into $OUT (the device machine's), else .device/out. Other arguments go to `python -m bench.device_check`
# (--budget-s, --model-dir, --random-weights). No python whose torch sees a GPU: it falls back to the dry run.
# DEVICE_CHECK_LIMIT_S (480) interrupts the check, which keeps what it found, should its own budget not hold.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VENV_PY="$REPO/.venv/bin/python"
OUT_DIR=${OUT:-.device/out}
SITE=/tmp/site
# What the services import that the device image lacks (pyzmq ... llguidance), or has at versions older than the
# generated gRPC and protobuf code accepts (grpcio, protobuf): pinned to this venv's versions by --prepare.
CARRIED=(pyzmq msgspec structlog grpcio grpcio-health-checking grpcio-reflection protobuf gguf llguidance)
SHAPE_FILES=(config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json)

prepare() {
    # Run where pip reaches PyPI and the model store has the embedded model (`make setup` does both).
    mkdir -p .git/info .whl .device/model-shape
    for ignored in /.whl/ /.device/; do
        grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >>.git/info/exclude
    done
    rm -f .whl/*.whl
    for name in "${CARRIED[@]}"; do
        version=$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")
        # The device image's glibc is 2.39 (Python 3.12.3, Ubuntu 24.04's): llguidance's wheels are 2_31's.
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            -d .whl "$name==$version" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    done
    model=$("$VENV_PY" -m modeling.model.store | tail -n 1)
    for file in "${SHAPE_FILES[@]}"; do
        cp "$model/$file" .device/model-shape/
    done
    ls -l .whl .device/model-shape
    du -sh .whl .device
}

sees_gpu() {
    "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null
}

install_wheels() {
    # The carried wheels, into $SITE, ahead of the python's own packages; a torch wheel only when its torch sees no
    # GPU (a CUDA torch is larger than all that may travel: the image's own is the one normally used).
    local py=$1 wheel
    local wheels=()
    for wheel in .whl/*.whl; do
        case $(basename "$wheel") in
        torch-*) sees_gpu "$py" || wheels+=("$wheel") ;;
        *) wheels+=("$wheel") ;;
        esac
    done
    ((${#wheels[@]})) || return 1
    echo "installing ${#wheels[@]} carried wheels into $SITE for $py"
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${wheels[@]}"; then
        echo "the carried wheels do not install for $py: going on without them" >&2
        return 1
    fi
}

if [[ ${1:-} == --prepare ]]; then
    prepare
    exit 0
fi

dry_run=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry_run=1; done
PY=python3
site_for=""  # the python the carried wheels were installed for
if ((!dry_run)); then
    # The wheels first: a carried torch wheel may be what sees the GPU.
    [[ -d .whl ]] && install_wheels "$PY" && site_for=$PY
    if ! PYTHONPATH=$SITE sees_gpu "$PY"; then
        if [[ -x $VENV_PY ]] && sees_gpu "$VENV_PY"; then
            PY=$VENV_PY
        else
            echo "no python here has a torch that sees a GPU: falling back to a dry run on the CPU" >&2
            dry_run=1
            set -- --dry-run "$@"
        fi
    fi
fi
if ((dry_run)); then
    # A CPU worker captures through the recording backend, which replays the same static-buffer forward, on torch's
    # ops as a GPU runs them.
    export SPECSERVE_GRAPH_BACKEND=recording SPECSERVE_NATIVE_OPS=0
    # One thread a worker: torch's threads wait on each other when another process holds a core (the check's own
    # other workers, or whatever else the machine runs), and a step then takes many times as long.
    export SPECSERVE_WORKER_THREADS=${SPECSERVE_WORKER_THREADS:-1}
    if [[ -x $VENV_PY ]]; then
        PY=$VENV_PY  # it has every package
    elif [[ -z $site_for && -d .whl ]] && install_wheels "$PY"; then
        site_for=$PY
    fi
fi
if [[ $site_for == "$PY" ]]; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__} (CUDA {torch.version.cuda}) "
      f"from {torch.__file__}; {gpu}")'

mkdir -p "$OUT_DIR"
timeout -s INT -k 30 "${DEVICE_CHECK_LIMIT_S:-480}" \
    "$PY" -m bench.device_check --json-out "$OUT_DIR/device_check.json" "$@" 2>&1 | tee "$OUT_DIR/device_check.log"
