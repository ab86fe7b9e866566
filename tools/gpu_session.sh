#!/usr/bin/env bash
# The GPU checks of issue 58, as one prepared command for a session lent a GPU machine.
#
# The lent machine is bare and offline: its python3 (3.12) has torch but not gymnasium, mujoco,
# omegaconf or stable-baselines3, and no registry can be reached from it. So, first, HERE (a
# machine with a registry), once per checkout:
#
#     bash tools/gpu_session.sh prepare
#
# downloads into .whl/ the wheels that machine lacks (cp312, x86-64, the versions installed here)
# and into .gl/ the EGL loader packages MuJoCo renders through (both git-ignored). Then, with the
# device tool:
#
#     run(command="bash tools/gpu_session.sh", carry=[".whl", ".gl"], timeout_s=600)
#
# runs, in order, each under `timeout`, each logging to $OUT/<step>.log, a failing step never
# stopping the next:
#
#   setup       what is importable; the carried EGL packages and wheels installed where needed (on a
#               machine with a registry and no .whl/: pip install -e ".[test]" stable-baselines3);
#               visppo itself; one rendered Reacher-v5 frame
#   probe       tools/validate_probe.py --device cuda --cap --json $OUT/probe_validation_cuda.json
#               (the 8 GiB headline check for fp32, bf16 and fp16 first, then its default CUDA grid,
#               each row followed by its run with the allocator capped at its estimate + 2%; it
#               rewrites its JSON after every row, so a cut-short run keeps the headline and whole
#               pairs; a failing child is recorded as a failed row and the next runs; PROBE_ARGS
#               replaces --cap)
#   expandable  (only when STEPS names it) the fp32 grid again, uncapped and capped, under
#               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, into
#               $OUT/probe_validation_cuda_expandable.json: whether that allocator's reserve follows
#               what it allocated closely enough for the probe to model it (EXPANDABLE_TIMEOUT, 240 s)
#   speed       tools/speed_vs_sb3.py --device cuda --json $OUT/speed_vs_sb3_cuda.json (visppo vs SB3,
#               end to end, interleaved, and visppo bench's placement; its JSON also after every repeat)
#   cudatests   (only when STEPS names it) the tests that skip without CUDA, on CUDA: pytest -k
#               "cuda or gpu" over the test files that have them (CUDATESTS_TIMEOUT, 90 s)
#   nvidia_smi, pip_list    snapshots
#
# The limits add up to under the 10 minutes of one command (about 9 at most):
# SETUP_TIMEOUT (90 s), PROBE_TIMEOUT (240 s), SPEED_TIMEOUT (180 s); SPEED_ARGS changes the
# speed script's sizes. STEPS (default "probe speed") picks the steps, so that a session can give
# each its own call, e.g. STEPS=probe PROBE_TIMEOUT=420, then STEPS="expandable speed", and
# STEPS="cudatests expandable" after the default call.
# Two steps to a call: at most 7 files land in $OUT (the device tool brings back 8).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}

if [ "${1:-}" = "prepare" ]; then  # HERE, not on the GPU machine
    set -e
    mkdir -p .whl .gl /tmp/amd64/partial
    pins=$($PY - <<'EOF'
import importlib.metadata as m
names = ["gymnasium", "farama-notifications", "mujoco", "glfw", "pyopengl", "omegaconf",
         "antlr4-python3-runtime", "stable-baselines3", "pytest", "pluggy", "iniconfig",
         "packaging", "pygments", "pytest-timeout"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
EOF
)
    echo "wheels: $pins"
    # shellcheck disable=SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download -qq libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    du -sh .whl .gl
    ls .whl .gl
    echo "now: run(command=\"bash tools/gpu_session.sh\", carry=[\".whl\", \".gl\"], timeout_s=600)"
    exit 0
fi

OUT=${OUT:-$PWD/gpu_session_out}
mkdir -p "$OUT"
export MUJOCO_GL=egl PYTHONUNBUFFERED=1

setup() {  # runs in this shell (its exports stay); each install under a time limit
    echo "python: $(command -v "$PY") $($PY --version 2>&1)"
    if ls .gl/*.deb >/dev/null 2>&1; then  # the device README's recipe: EGL/GL loaders into /
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig
        echo "unpacked $(ls .gl/*.deb | wc -l) EGL/GL packages from .gl/"
    fi
    ldconfig -p | grep -q 'libEGL.so.1' || echo "warning: no libEGL.so.1: MuJoCo cannot render (carry .gl/)"
    missing=$($PY - <<'EOF'
import importlib.util
need = ["gymnasium", "mujoco", "omegaconf", "stable_baselines3", "OpenGL"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
    echo "missing before setup: ${missing:-nothing}"
    if [ -n "$missing" ]; then
        if ls .whl/*.whl >/dev/null 2>&1; then
            timeout -k 10 "$SETUP_TIMEOUT" $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site .whl/*.whl && echo "installed $(ls .whl/*.whl | wc -l) carried wheels"
            export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        else  # a machine with a registry
            timeout -k 10 "$SETUP_TIMEOUT" $PY -m pip install -q -e ".[test]" stable-baselines3
        fi
    fi
    if ! $PY -c "import visppo, visppo_envs, sys; sys.exit(not visppo.__file__.startswith('$PWD/'))" 2>/dev/null; then
        if ! timeout -k 10 "$SETUP_TIMEOUT" $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
            echo "pip install -e . failed: visppo from PYTHONPATH instead"
            mkdir -p /tmp/site && ln -sfn "$PWD/envs" /tmp/site/visppo_envs
            export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        fi
    fi
    render='import gymnasium as gym; e = gym.make("Reacher-v5", render_mode="rgb_array", width=84, height=84); e.reset(seed=0); print("rendered", e.render().shape); e.close()'
    nvidia_egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    if ! timeout -k 5 60 $PY -c "$render" && [ -f "$nvidia_egl" ]; then  # a hung EGL must not eat the call  # the device README's fallback: name NVIDIA's EGL vendor
        export __EGL_VENDOR_LIBRARY_FILENAMES=$nvidia_egl
        echo "retrying with __EGL_VENDOR_LIBRARY_FILENAMES=$nvidia_egl"
        timeout -k 5 60 $PY -c "$render"
    fi
    timeout -k 5 60 $PY -c "import torch, visppo, gymnasium, mujoco, stable_baselines3; print('visppo', visppo.__file__); \
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''); \
print('gymnasium', gymnasium.__version__, 'mujoco', mujoco.__version__, 'sb3', stable_baselines3.__version__)"
}

step() {  # step NAME SECONDS COMMAND...: its log in $OUT/NAME.log, its exit code and time on stdout
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc$([ $rc = 124 ] && echo " (cut at ${limit} s)") in $(( $(date +%s) - start )) s"
}

SETUP_TIMEOUT=${SETUP_TIMEOUT:-90}
start=$(date +%s)
setup >"$OUT/setup.log" 2>&1
echo "setup: done in $(( $(date +%s) - start )) s (see setup.log)"
tail -n 4 "$OUT/setup.log"
STEPS=${STEPS:-probe speed}
case " $STEPS " in *" probe "*)
    # shellcheck disable=SC2086
    step probe "${PROBE_TIMEOUT:-240}" $PY tools/validate_probe.py --device cuda ${PROBE_ARGS:---cap} \
        --json "$OUT/probe_validation_cuda.json" ;;
esac
case " $STEPS " in *" expandable "*)
    step expandable "${EXPANDABLE_TIMEOUT:-240}" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        $PY tools/validate_probe.py --device cuda --amp off --no-headline --cap \
        --json "$OUT/probe_validation_cuda_expandable.json" ;;
esac
case " $STEPS " in *" speed "*)
    # shellcheck disable=SC2086
    step speed "${SPEED_TIMEOUT:-180}" $PY tools/speed_vs_sb3.py --device cuda ${SPEED_ARGS:---iterations 4 --repeats 3} \
        --json "$OUT/speed_vs_sb3_cuda.json" ;;
esac
case " $STEPS " in *" cudatests "*)  # -o addopts=: not the project's "-n 2" (xdist is not carried)
    step cudatests "${CUDATESTS_TIMEOUT:-90}" $PY -m pytest -q -rs -p no:cacheprovider -o addopts= \
        -m "not slow" -k "cuda or gpu" tests/test_buffer.py tests/test_memory.py tests/test_ppo.py \
        tests/test_train.py ;;
esac
step nvidia_smi 20 nvidia-smi
step pip_list 30 $PY -m pip list
for s in $STEPS; do echo "--- $s.log"; tail -n 12 "$OUT/$s.log"; done
