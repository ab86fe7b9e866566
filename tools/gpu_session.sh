#!/usr/bin/env bash
# The GPU checks of issue 58, as one prepared command for a session lent a GPU machine.
#
# The lent machine is bare and offline: its python3 (3.12) has torch but not gymnasium, mujoco,
# omegaconf, stable-baselines3 or dm_control, and no registry can be reached from it. So, first,
# HERE (a machine with a registry), once per checkout:
#
#     bash tools/gpu_session.sh prepare
#
# downloads into .whl/ the wheels that machine lacks (cp312, x86-64, the versions installed here;
# dm_control trimmed by tools/trim_wheel.py to what dm_control.suite loads, dog-* tasks' meshes
# left out, 54 MiB -> 240 KiB, so that the tree and both folders stay well under the 64 MiB a call
# carries: prepare prints the total) and
# into .gl/ the EGL loader packages MuJoCo renders through (both git-ignored). Then, with the
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
#               replaces --cap); with --traces, every uncapped row's allocator actions, packed at the
#               step's end into $OUT/alloc_traces.tar (what tools/alloc_model.py, a model of the
#               caching allocator, is checked against on a machine without a GPU). The whole grid
#               takes longer than one call: PROBE_RESUME=FILE (a JSON an earlier call brought back,
#               put in the working tree, which the call carries) runs only what FILE lacks and
#               writes FILE's rows with the new ones (--resume); where validate_probe refuses FILE
#               (another GPU, torch or CUDA made it), the grid runs afresh instead
#   expandable  (only when STEPS names it) the fp32 grid again, uncapped and capped, under
#               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, into
#               $OUT/probe_validation_cuda_expandable.json: whether that allocator's reserve follows
#               what it allocated closely enough for the probe to model it (EXPANDABLE_TIMEOUT, 240 s)
#   speed       tools/speed_vs_sb3.py --device cuda --json $OUT/speed_vs_sb3_cuda.json (visppo vs SB3,
#               end to end, interleaved, and visppo bench's placement; its JSON also after every repeat)
#   cudatests   (only when STEPS names it) the tests marked `cuda` (they skip without CUDA), on
#               CUDA, in one process, but for those that measure in child processes (the probe
#               step runs their rows and headlines): pytest -m "cuda and not cuda_children" over the
#               files that have them (CUDATESTS_TIMEOUT, 90 s)
#   dmc         (only when STEPS names it) issue 58 step 3, a DMC row on the suite's own look
#               (env.kwargs.look=published): one cartpole-swingup frame rendered through
#               visppo_envs.dmc (60 s); `visppo train DMC_CONFIG` (configs/dmc_cartpole_swingup.yaml,
#               the one recipe) with train.device=cuda train.amp=off (fp32, as the fast-look rows trained:
#               only the look differs) run.progress=false, its run dir in /tmp, for
#               DMC_TIMEOUT s, then one SIGTERM: visppo ends the iteration in progress, writes its
#               checkpoint and exits 143 (SIGKILL DMC_GRACE s later, 60); then `visppo eval` of that
#               checkpoint, 10 deterministic episodes on the same look (DMC_EVAL_TIMEOUT, 90 s).
#               DMC_TIMEOUT (auto) is by default what is left of DMC_CALL_LIMIT (590 s from the
#               call's start) once the steps before it ran and the worst case of what follows is set
#               aside (DMC_GRACE + DMC_EVAL_TIMEOUT + 90 s: the evaluation's kill, the machine step
#               and the packing, seconds when nothing hangs), at least 10 s: about 300 s of training
#               in a call of its own, which then ends within its 10 minutes. It leaves
#               dmc.log (the commands' output, the eval JSON, the metrics' last rows) and
#               dmc_run.tar.gz (metrics.csv, config.yaml, then eval.json) in $OUT. DMC_ARGS adds
#               training overrides. Best a call of its own, the session's (15 minutes of device
#               time hold one cold start and one 10-minute call, not this and the default one):
#                   run(command="STEPS=dmc bash tools/gpu_session.sh", carry=[".whl", ".gl"],
#                       timeout_s=600)
#   machine     nvidia-smi and pip list, one log
#
# The limits add up to under the 10 minutes of one command (about 9 at most):
# SETUP_TIMEOUT (90 s), PROBE_TIMEOUT (240 s), SPEED_TIMEOUT (180 s); SPEED_ARGS changes the
# speed script's sizes. STEPS (default "probe speed") picks the steps, so that a session can give
# each its own call, e.g. STEPS=probe PROBE_TIMEOUT=420, then STEPS="expandable speed", and
# STEPS="cudatests expandable" after the default call (STEPS=dmc: see above).
# Files in $OUT: setup.log and machine.log, and two a step (its log, and its JSON or dmc's
# tarball; probe three: its traces too; cudatests: its log only). The default call leaves 7 (the
# device tool brings back 8); any two steps at most 7; three steps only with cudatests, not probe.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
CALL_START=$(date +%s)

if [ "${1:-}" = "prepare" ]; then  # HERE, not on the GPU machine
    set -e
    mkdir -p .whl .gl /tmp/amd64/partial
    pins=$($PY - <<'EOF'
import importlib.metadata as m
names = ["gymnasium", "farama-notifications", "mujoco", "glfw", "pyopengl", "omegaconf",
         "antlr4-python3-runtime", "stable-baselines3", "pytest", "pluggy", "iniconfig",
         "packaging", "pygments", "pytest-timeout", "dm-env"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
EOF
)
    dmc_pin=dm-control==$($PY -c 'import importlib.metadata as m; print(m.version("dm-control"))')
    echo "wheels: $pins $dmc_pin (trimmed)"
    dl=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    # shellcheck disable=SC2086
    $PY "${dl[@]}" -d .whl $pins
    # dm_control without what dm_control.suite never imports or reads (locomotion/'s walkers and
    # soccer assets, mujoco/testing/'s frames, manipulation/ and the packages only they import) and
    # without the dog's meshes (9 MiB; no config of visppo's trains a dog task): every other suite
    # task loads there; the build tag 0trimmed marks the wheel.
    full=$(mktemp -d)
    $PY "${dl[@]}" -d "$full" "$dmc_pin"
    rm -f .whl/dm_control-*.whl
    src=$(ls "$full"/dm_control-*-py3-none-any.whl)
    base=$(basename "$src")
    $PY tools/trim_wheel.py "$src" ".whl/${base/-py3-none-any/-0trimmed-py3-none-any}" \
        --drop dm_control/locomotion/ --drop dm_control/manipulation/ --drop dm_control/mujoco/testing/ \
        --drop dm_control/composer/ --drop dm_control/mjcf/ --drop dm_control/entities/ \
        --drop dm_control/third_party/ --drop dm_control/viewer/ --drop dm_control/blender/ \
        --drop dm_control/autowrap/ --drop dm_control/suite/all_domains.png --drop dm_control/suite/explore.py \
        --drop dm_control/suite/dog_assets/
    rm -rf "$full"
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download -qq libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    du -sh .whl .gl
    ls .whl .gl
    tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f 1)
    carried=$(du -cb .whl .gl | tail -n 1 | cut -f 1)
    echo "a call carries $(( (tree + carried) >> 20 )) MiB of 64: tracked tree $(( tree >> 20 )) MiB," \
        ".whl and .gl $(( carried >> 20 )) MiB (and any untracked file git does not ignore)"
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
    missing=$($PY - "$STEPS" <<'EOF'
import importlib.util, sys
need = ["gymnasium", "mujoco", "omegaconf", "stable_baselines3", "OpenGL"]
if "dmc" in sys.argv[1].split():
    need += ["dm_control", "dm_env"]
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

pack() {  # pack ARCHIVE TAR_FLAGS FOLDER: FOLDER's files into ARCHIVE, whole or not at all, under 16 MiB
    local archive=$1 flags=$2 folder=$3 size
    if [ ! -d "$folder" ]; then echo "$(basename "$archive"): no $folder, nothing packed"; return 1; fi
    tar "$flags" "$archive.part" -C "$folder" . || return 1
    size=$(stat -c %s "$archive.part")
    if [ "$size" -gt $(( 15 * 2**20 )) ]; then  # the device tool brings back no file over 16 MiB
        rm -f "$archive.part"
        echo "$(basename "$archive"): $(( size >> 20 )) MiB, over what comes back: not packed"
        return 1
    fi
    mv "$archive.part" "$archive" && echo "$(basename "$archive"): $(( size >> 10 )) KiB"
}

dmc() {  # issue 58 step 3: the one DMC recipe on the suite's own look, stopped, then evaluated
    local run=${TMPDIR:-/tmp}/gpu_session_dmc keep=${TMPDIR:-/tmp}/gpu_session_dmc_keep rc erc=none
    rm -rf "$run" "$keep"
    mkdir -p "$keep"
    echo "== one frame through visppo_envs.dmc"
    timeout -k 5 60 $PY -c "import dm_control, visppo_envs.dmc as d; e = d.DMCEnv('cartpole', 'swingup', look='published'); \
o, _ = e.reset(seed=0); print('dm_control', dm_control.__file__, 'frame', o.shape, o.dtype, 'mean %.1f' % o.mean()); e.close()"
    local limit=$DMC_TIMEOUT
    if [ "$limit" = auto ]; then  # the rest of the call, the worst case of what follows set aside
        limit=$(( DMC_CALL_LIMIT - ($(date +%s) - CALL_START) - DMC_GRACE - DMC_EVAL_TIMEOUT - 90 ))
        [ "$limit" -ge 10 ] || limit=10
    fi
    echo "== train $DMC_CONFIG for $limit s, then SIGTERM"
    # --foreground: one SIGTERM, to visppo alone (a second one would abort it without a checkpoint;
    # its env workers leave signals to it); --preserve-status: visppo's own exit code
    # shellcheck disable=SC2086
    timeout --foreground --preserve-status -k "$DMC_GRACE" "$limit" $PY -m visppo train "$DMC_CONFIG" \
        env.kwargs.look=published train.device=cuda train.amp=off run.progress=false run.dir="$run" $DMC_ARGS
    rc=$?
    echo "train: exit $rc (143: stopped by SIGTERM, checkpoint written; 0: finished; 137: killed)"
    for f in metrics.csv config.yaml; do  # packed now, and again with eval.json: a cut call keeps them
        if [ -f "$run/$f" ]; then cp "$run/$f" "$keep/"; fi
    done
    pack "$OUT/dmc_run.tar.gz" -czf "$keep"
    if [ -f "$run/checkpoints/latest.pt" ]; then
        echo "== eval $run: 10 deterministic episodes on the suite's look"
        timeout -k 10 "$DMC_EVAL_TIMEOUT" $PY -m visppo eval "$run" --episodes 10 --deterministic \
            --json "$keep/eval.json" env.kwargs.look=published
        erc=$?
        echo "eval: exit $erc"
    else
        echo "no $run/checkpoints/latest.pt: nothing to evaluate"
    fi
    pack "$OUT/dmc_run.tar.gz" -czf "$keep"
    echo "== dmc_run.tar.gz: $(cd "$keep" && echo *)"
    if [ -f "$keep/eval.json" ]; then cat "$keep/eval.json"; echo; fi
    if [ -f "$keep/metrics.csv" ]; then head -n 1 "$keep/metrics.csv"; tail -n 3 "$keep/metrics.csv"; fi
    { [ "$rc" = 143 ] || [ "$rc" = 0 ]; } && [ "$erc" = 0 ]  # the step's exit code
}

SETUP_TIMEOUT=${SETUP_TIMEOUT:-90}
STEPS=${STEPS:-probe speed}
start=$(date +%s)
setup >"$OUT/setup.log" 2>&1
echo "setup: done in $(( $(date +%s) - start )) s (see setup.log)"
tail -n 4 "$OUT/setup.log"
case " $STEPS " in *" probe "*)
    # shellcheck disable=SC2086
    traces=${TMPDIR:-/tmp}/alloc_traces
    rm -rf "$traces"  # a warm machine's earlier call must not add its traces to this call's
    resume=()
    [ -n "${PROBE_RESUME:-}" ] && resume=(--resume "$PROBE_RESUME")
    # shellcheck disable=SC2086
    step probe "${PROBE_TIMEOUT:-240}" $PY tools/validate_probe.py --device cuda ${PROBE_ARGS:---cap} \
        --traces "$traces" "${resume[@]}" --json "$OUT/probe_validation_cuda.json"
    if [ ${#resume[@]} -gt 0 ] && grep -q "^error: --resume" "$OUT/probe.log"; then  # a fresh grid, not a lost call
        echo "probe: $(grep -m 1 "^error: --resume" "$OUT/probe.log"); running the grid afresh"
        # shellcheck disable=SC2086
        step probe "${PROBE_TIMEOUT:-240}" $PY tools/validate_probe.py --device cuda ${PROBE_ARGS:---cap} \
            --traces "$traces" --json "$OUT/probe_validation_cuda.json"
    fi
    pack "$OUT/alloc_traces.tar" -cf "$traces" ;;
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
case " $STEPS " in *" cudatests "*)  # -o addopts=: one process (not the project's "-n 2")
    step cudatests "${CUDATESTS_TIMEOUT:-90}" $PY -m pytest -q -rs -p no:cacheprovider -o addopts= \
        -m "cuda and not cuda_children and not slow" $(grep -l "pytest.mark.cuda" tests/test_*.py) ;;  # only those files: the others may import what is not carried
esac
case " $STEPS " in *" dmc "*)  # its commands run under limits of their own
    DMC_CONFIG=${DMC_CONFIG:-configs/dmc_cartpole_swingup.yaml} DMC_TIMEOUT=${DMC_TIMEOUT:-auto}
    DMC_CALL_LIMIT=${DMC_CALL_LIMIT:-590} DMC_GRACE=${DMC_GRACE:-60} DMC_EVAL_TIMEOUT=${DMC_EVAL_TIMEOUT:-90}
    DMC_ARGS=${DMC_ARGS:-}
    start=$(date +%s)
    dmc >"$OUT/dmc.log" 2>&1
    echo "dmc: exit $? in $(( $(date +%s) - start )) s" ;;
esac
step machine 40 sh -c "nvidia-smi; $PY -m pip list"
for s in $STEPS; do echo "--- $s.log"; tail -n 12 "$OUT/$s.log"; done
