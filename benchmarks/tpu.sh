#!/usr/bin/env bash
# The TPU v5e measurements of issue 35 (docs/performance.md: On one TPU v5e) as one script, for
# the device machine: one TPU v5e chip (15.75 GiB, 197 TFLOP/s bf16), Python 3.11 with JAX
# 0.10.2 and libtpu, no registry, its own package index at /opt/pypi/simple. Every measurement
# goes into the record $OUT/tpu-v5e.json (commit it as benchmarks/results/tpu-v5e.json; when that
# file exists in the checkout it is copied to $OUT first, so that device calls add to it):
#
#   bash benchmarks/tpu.sh [step]   (default; ~9 minutes) the training step of
#     benchmarks/configs/deepseek4-d1024.yml with AdamW, bf16 weights and optimizer state, full
#     remat, each a run of the record (model_step.py --record) and its JSON line in
#     $OUT/d1024.json, in the order of what XLA's memory analysis compiled on the CPU says
#     (benchmarks/aot_memory.py, docs/performance.md):
#     1. 4 x (2 x 2048) = 16,384 tokens by gradient accumulation (15.22 of 15.75 GiB by XLA),
#     2. 8 x 2048 in one micro-batch (XLA's heap peak 14.06 GiB fits, its arguments + temporary
#        block 17.02 GiB do not: the device peak or the failure says which the chip follows),
#     3. 2 x 2048 (the run of 2026-12-05, 0.511 s, 15.1 GiB, before the step donated its state;
#        donating, XLA plans 12.83 GiB);
#   bash benchmarks/tpu.sh remat    (~8 minutes) issue 40's 16,384 tokens a step as 4 x (2 x 2048)
#     with less recomputation than `goals`' full remat, the two policies XLA compiles for the
#     chip on the CPU (benchmarks/aot_memory.py; remat none is refused even at 1 x 2048):
#     remat_policy=minimal (temporaries 9.59 GiB) and save_experts, each a run of the record;
#   bash benchmarks/tpu.sh experts  (~8 minutes) issue 40's goal 4: the MoE layer alone
#     (moe_layer.py: forward + backward against a dense SwiGLU of the same FLOPs), ragged_dot
#     and megablox at row tiles 128-512: the d1024 experts (64 of 1024 x 512, top-6) on one
#     2 x 2048 micro-batch with column tiles 256 and 512 (97 s on 2026-12-06), then both of issue
#     35's shapes on 16,384 tokens with column tiles 512 and 1024 (256 was 1.2-1.9x slower in
#     every run; with it this part ran past its 300 s limit on the second shape)
#     -> $OUT/moe_layer.json (a JSON line each; benchmarks/results/moe-layer-v5e.json);
#   bash benchmarks/tpu.sh gmm      (~2 minutes) benchmarks/grouped_matmul.py: the experts' grouped
#     matmul alone, ragged_dot against tokamax's TPU kernel at several tiles, at the d1024 shapes
#     -> $OUT/grouped-matmul.json (benchmarks/results/grouped-matmul-v5e.json);
#   bash benchmarks/tpu.sh profile [key=value ...]  (~4 minutes) profile_step.py on the best
#     16,384-token step, 4 x (2 x 2048) with remat minimal, the overrides given: device time by
#     part ($OUT/profile-d1024.json, its tables and the 40 slowest operations in $OUT/log.txt),
#     the optimized HLO and the trace in $OUT/profile/ (profile_step.py --keep);
#   bash benchmarks/tpu.sh peer     (~6 minutes: its own device call) MaxText's DeepSeek-V4 at the
#     same width (shared/peers/maxtext-tpu copied into .peer/ and carried), its steps -> "peer";
#   bash benchmarks/tpu.sh ab [twice]  `moebalance ab deepseek4-tiny` on the chip, and with `twice`
#     the same again with the compilation cache warm -> "ab" (first_s, second_s, its table's total),
#     each run's programs timed by benchmarks/program_log.py ($OUT/programs-1.json, -2.json);
#     AB_OVERRIDES="key=value ..." gives both runs config overrides (e.g. remat_policy=full);
#   bash benchmarks/tpu.sh speed    (~8 minutes) the issue-40 pair: profile_step.py on the 8-layer
#     2 x 2048 step (device time by part, $OUT/profile-d1024.json) and model_step.py at MaxText's
#     shape (9 layers [0,0,4,128,4,128,4,128,4], 2 x 2048, shared/peers/maxtext-tpu) -> a run;
#   bash benchmarks/tpu.sh d1024 B A [key=value ...]  (~4 minutes) one run of the record: the
#     d1024 step with bf16 weights, A micro-batches of B x 2048 tokens, the overrides given
#     (e.g. `d1024 4 2 remat_policy=minimal`: 16,384 tokens a step as 2 x (4 x 2048));
#   bash benchmarks/tpu.sh goals    (~8 minutes) the guard of the step's speed (issue 58), two runs
#     of the record: MaxText's shape as in `speed`, then the best 16,384-token step on 8 layers,
#     4 x (2 x 2048) with remat minimal; run it first and last in a session that changes the
#     step, with COMMIT=<short hash> in the call so that each row names the commit it measured;
#   bash benchmarks/tpu.sh lowering  (~1 minute) benchmarks/lowering.py: how long the host traces and
#     lowers deepseek4-tiny's programs, alone and beside their compilations -> $OUT/lowering.json;
#   bash benchmarks/tpu.sh startup  (~2 minutes) benchmarks/startup.py: whether the packages' bytecode
#     is found, the A/B's imports timed in fresh processes, the chip's opening and the process's
#     exit, also with libtpu's premapped buffer at each of $PREMAPPED's sizes -> $OUT/startup.json;
#   bash benchmarks/tpu.sh abprofile  the A/B again under cProfile (AB_OVERRIDES as for `ab`):
#     $OUT/ab.prof, abprofile.txt;
#   bash benchmarks/tpu.sh cli      train (deepseek4-smoke, 20 steps), eval, generate and export as
#     README.md shows them, the last three on the A/B's Run B (that `ab` left in /tmp/ab on the
#     machine, or made here), each a part;
#   bash benchmarks/tpu.sh study [ARGS...]  issue 42's run: `moebalance study deepseek4-study ARGS`
#     (default: three arms of 2,000 steps) into /tmp/study, stopped by SIGINT after $STUDY_LIMIT
#     seconds (default 540) with a checkpoint, which the same call on the still-warm machine
#     continues; on a fresh machine STUDY_FROM=FILE (a study.json brought back by an earlier call)
#     keeps that study's finished arms and trains the others; study.json and study.md -> $OUT
#     (STUDY_SRC=DIR with COMMIT=C: the study runs the code of commit C, archived into DIR and
#     carried, whatever the checkout holds: every arm at one commit across sessions;
#     2026-12-06/07: --arm aux --arm loss-free, the loss-free arm 759 s over two calls,
#     study-v5e.json; at 65521cf's 4 x 1024 tokens three arms in 1,232 s, study-v5e-65521cf.json);
#   bash benchmarks/tpu.sh functions  (~30 s) benchmarks/tpu_functions.py: the chip's float32
#     transcendentals against float64 ($OUT/functions.json), whence the tests' TPU tolerances;
#   bash benchmarks/tpu.sh tests [ARGS...]  `pytest -n 0 --device-tests` on ARGS (files, test
#     ids, or @FILE of test ids: pytest reads the arguments from it), stopped after $TESTS_LIMIT
#     seconds (default 540) as by Ctrl-C, reporting what ran (default the whole selection) ->
#     "tests", JUnit XML in $OUT/tests.xml, its output in $OUT/tests.txt, each test's JAX
#     compilations and their seconds in $OUT/test-compiles.json (benchmarks/pytest_compiles.py).
#     The installation takes 12 s on a fresh machine (2026-12-07: 48 wheels unpacked in 3.8 s; with
#     pip it took over 100 s). Two device calls hold the whole selection: the first runs it all
#     until its limit, the second the tests the first's tests.xml lacks, listed in a file.
#
# Each part has its own time limit (opening the chip costs ~15 s per program, and only one
# program holds it at a time), all well under the device call's 600 s. Logs: $OUT/log.txt
# (default OUT=/tmp/tpu). What the machine's index lacks or holds at other versions comes as
# wheels in .whl-tpu/ (made here by benchmarks/tpu_wheels.sh, carried: `carry: [".whl-tpu"]`);
# all go into /tmp/site, after the machine's own packages on PYTHONPATH (its JAX stays first).
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/tpu}  # run.sh of the peer writes its log there too
MODE=${1:-step}
mkdir -p "$OUT"
RECORD=$OUT/tpu-v5e.json
if [ -f benchmarks/results/tpu-v5e.json ] && [ ! -f "$RECORD" ]; then
    cp benchmarks/results/tpu-v5e.json "$RECORD"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# Python's bytecode kept as on a user's machine: this one sets PYTHONDONTWRITEBYTECODE, its JAX
# folder is read-only and what pip puts in /tmp/site has none, so every process compiled the
# sources of every module it imported (the A/B's imports 5.8 s a process; with the bytecode kept
# under $PYTHONPYCACHEPREFIX 4.8 s, and the warm A/B 51 s against 54: startup.py, 2026-12-07)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
D1024=benchmarks/configs/deepseek4-d1024.yml
BF16="weight_dtype=bfloat16 remat_policy=full"  # fp32 weights + AdamW: 16.7 GiB of state alone
# the commit measured, given by the caller (the device machine's copy has no .git):
# COMMIT=$(git rev-parse --short HEAD) in the device call's command
NOTES="benchmarks/tpu.sh${COMMIT:+; project at $COMMIT}"
# and the study records it per run (runtime.code_commit: the copy has no .git to read it from)
if [ -n "${COMMIT:-}" ]; then export MOEBALANCE_COMMIT=$COMMIT; fi
PACKAGES="jax|jaxlib|libtpu|flax|optax|orbax-checkpoint|numpy|ml.dtypes|pyyaml|rich|grain"
PACKAGES="$PACKAGES|tokenizers"
PACKAGES="$PACKAGES|tensorboardx|matplotlib|pyarrow|protobuf"
PIP_DOWNLOAD="env PIP_CONFIG_FILE=/dev/null python3 -m pip download --isolated -q --no-cache-dir"

. benchmarks/parts.sh  # log, part

# the large packages from the machine's index, the rest from .whl-tpu, all without dependencies
# (nothing may replace the machine's JAX), unpacked side by side into /tmp/site
# (benchmarks/unpack_wheels.py: pip's two installations took over 100 s of a fresh machine's first
# call); once per machine (a warm machine keeps /tmp/site)
if [ ! -f /tmp/site/.installed ]; then
    start=$SECONDS
    if ! compgen -G ".whl-tpu/*.whl" > /dev/null; then
        echo "no .whl-tpu/: run benchmarks/tpu_wheels.sh here and carry .whl-tpu" | log
    fi
    rm -rf /tmp/wheels && $PIP_DOWNLOAD --only-binary=:all: --index-url file:///opt/pypi/simple \
        --no-deps -d /tmp/wheels tensorstore tokenizers pyyaml typing_extensions protobuf pyarrow \
        matplotlib contourpy cycler fonttools kiwisolver packaging pillow pyparsing \
        python-dateutil six nest_asyncio 2>&1 | log &&
        python3 benchmarks/unpack_wheels.py /tmp/site /tmp/wheels/*.whl .whl-tpu/*.whl 2>&1 | log &&
        touch /tmp/site/.installed
    echo "installation: $((SECONDS - start)) s" | log
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 --version | log
python3 -m pip list 2>/dev/null | grep -iE "^($PACKAGES)\s" | log
# the chip opened only where a part does not say which devices it ran on (~15 s each opening)
if [ "$MODE" != tests ]; then
    python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__,
                                        jax.devices())' 2>&1 | log
fi

case "$MODE" in
step)
    part 200 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
        --steps 5 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" $BF16 \
        gradient_accumulation_steps=4
    part 200 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 \
        --steps 5 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" $BF16
    part 120 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
        --steps 5 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" $BF16
    cat "$OUT/d1024.json"
    ;;
remat)
    for policy in minimal save_experts; do
        part 280 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
            --steps 4 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" \
            weight_dtype=bfloat16 remat_policy=$policy gradient_accumulation_steps=4
    done
    cat "$OUT/d1024.json"
    ;;
experts)
    MOE="python3 benchmarks/moe_layer.py --dtype bfloat16 --dispatch ragged --kernels xla,megablox"
    part 150 moe_layer $MOE --tokens 4096 --block-sizes 128,256,512 --col-tiles 256,512 \
        --shapes 64:6:1024:512 --only-shapes
    part 400 moe_layer $MOE --tokens 16384 --block-sizes 128,256,512 --col-tiles 512,1024 \
        --shapes 64:6:1024:512,16:6:4096:2048 --only-shapes
    cat "$OUT/moe_layer.json"
    ;;
gmm)
    part 300 gmm python3 benchmarks/grouped_matmul.py "$OUT/grouped-matmul.json"
    ;;
profile)
    shift
    part "${PART_LIMIT:-290}" profile-d1024 python3 benchmarks/profile_step.py \
        --config "$D1024" --batch 2 --seq 2048 --steps 1 --top 40 --keep "$OUT/profile" \
        weight_dtype=bfloat16 remat_policy=minimal gradient_accumulation_steps=4 "$@"
    cat "$OUT/profile-d1024.json"
    ;;
peer)
    if [ -f .peer/maxtext-tpu/run.sh ]; then
        part 420 maxtext bash .peer/maxtext-tpu/run.sh
        python3 benchmarks/tpu_record.py peer "$RECORD" "$OUT/maxtext.log" 2>&1 | log
    else
        echo "no .peer/maxtext-tpu: copy shared/peers/maxtext-tpu there and carry .peer" | log
    fi
    ;;
speed)
    part 280 profile-d1024 python3 benchmarks/profile_step.py --config "$D1024" --batch 2 \
        --seq 2048 --steps 3 --top 25 $BF16
    part 280 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
        --steps 5 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES: MaxText's shape" $BF16 \
        base_num_decoder_layers=9 "compress_ratios=[0,0,4,128,4,128,4,128,4]"
    cat "$OUT/d1024.json"
    ;;
d1024)
    shift
    part "${PART_LIMIT:-290}" d1024 python3 benchmarks/model_step.py --config "$D1024" \
        --batch "$1" --seq 2048 --steps 4 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" \
        weight_dtype=bfloat16 "gradient_accumulation_steps=$2" "${@:3}"
    cat "$OUT/d1024.json"
    ;;
goals)
    part 280 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
        --steps 5 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES: MaxText's shape" $BF16 \
        base_num_decoder_layers=9 "compress_ratios=[0,0,4,128,4,128,4,128,4]"
    part 290 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 2 --seq 2048 \
        --steps 4 --dtypes bfloat16 --record "$RECORD" --notes "$NOTES" $BF16 \
        gradient_accumulation_steps=4 remat_policy=minimal
    cat "$OUT/d1024.json"
    ;;
tests)
    shift
    # SIGINT at the limit: pytest stops as on Ctrl-C, and still reports what ran (failures,
    # durations, the JUnit XML); killed, it reported nothing (2026-12-06: 95 of 188 tests in 470 s)
    # each test's compilations and their seconds (benchmarks/pytest_compiles.py) -> $OUT
    PYTHONPATH=$PYTHONPATH:benchmarks timeout -s INT "${TESTS_LIMIT:-540}" python3 -m pytest \
        -p no:cacheprovider -p pytest_compiles --compiles-json "$OUT/test-compiles.json" -n 0 \
        --device-tests -q -rf --durations=25 --junitxml="$OUT/tests.xml" "$@" 2>&1 |
        tee "$OUT/tests.txt" | tail -80
    python3 benchmarks/tpu_record.py tests "$RECORD" "$OUT/tests.xml" "$(date +%F)" 2>&1 | log
    ;;
study)
    shift
    dir=/tmp/study
    if [ ! -f "$dir/study.json" ] && [ -n "${STUDY_FROM:-}" ]; then
        mkdir -p "$dir" && cp "$STUDY_FROM" "$dir/study.json"
    fi
    df -h /tmp | log
    # a study spread over sessions runs one commit's code in all of them: STUDY_SRC=DIR (carried,
    # made by `git archive C | tar -x -C DIR`) runs DIR/src with MOEBALANCE_COMMIT=C (COMMIT)
    src=src
    if [ -n "${STUDY_SRC:-}" ]; then src=$STUDY_SRC/src; fi
    PYTHONPATH=$src:$PYTHONPATH timeout -s INT "${STUDY_LIMIT:-540}" python3 -m moebalance.cli \
        study deepseek4-study "$@" --out "$dir" 2>&1 | tee "$OUT/study.txt" |
        grep -v "^\s*$" | tail -40
    # a device call brings back only a handful of files: study.json holds every number (each
    # arm's steps too), and `moebalance report DIR --out DIR` redraws the figures and the page
    cp "$dir"/study.json "$dir"/study.md "$OUT/" 2>/dev/null
    ls -l "$dir" | log
    ;;
functions)
    python3 benchmarks/tpu_functions.py > "$OUT/functions.json" 2>> "$OUT/log.txt"
    cat "$OUT/functions.json"
    ;;
lowering)
    # the host's tracing and lowering of deepseek4-tiny's programs (benchmarks/lowering.py):
    # alone, then beside their compilations (after `ab`: loads from the compilation cache)
    for how in "" --beside; do
        part 150 lowering python3 benchmarks/lowering.py $how deepseek4-tiny ${AB_OVERRIDES:-}
    done
    cat "$OUT/lowering.json"
    ;;
startup)
    # where a command's first seconds go (benchmarks/startup.py): the packages' bytecode, the
    # imports of `moebalance ab` twice (and twice more with $PYTHONPYCACHEPREFIX), the chip's opening
    # (first as the machine sets Python up, so the prefix is this script's, not startup.py's)
    # (then the chip opened with libtpu's premapped host buffer at each of PREMAPPED's sizes)
    env -u PYTHONPYCACHEPREFIX PYTHONDONTWRITEBYTECODE=1 python3 benchmarks/startup.py \
        --pycache-prefix /tmp/pycache-startup \
        --premapped "${PREMAPPED:-4294967296,1073741824,268435456,67108864}" \
        > "$OUT/startup.json" 2>> "$OUT/log.txt"
    cat "$OUT/startup.json"
    ;;
abprofile)
    # where the A/B's time goes on the chip: the same command under cProfile (after `ab`, so with
    # its caches warm), its 60 largest cumulative times in $OUT/abprofile.txt
    part 300 abprofile python3 -m cProfile -o "$OUT/ab.prof" -m moebalance.cli ab deepseek4-tiny \
        ${AB_OVERRIDES:-} --out "$OUT/abprofile"
    python3 -c "import pstats, sys; (pstats.Stats(sys.argv[1], stream=open(sys.argv[2], 'w'))
                .sort_stats('cumulative').print_stats(60))" "$OUT/ab.prof" "$OUT/abprofile.txt"
    rm -rf "$OUT/abprofile"
    ;;
cli)
    # the commands of README.md's table on the A/B's Run B (`ab` first, or here)
    run=/tmp/ab/run_b
    [ -d "$run" ] || part 300 ab python3 -m moebalance.cli ab deepseek4-tiny --out /tmp/ab
    part 150 train python3 -m moebalance.cli train deepseek4-smoke steps=20 --out "$OUT/smoke"
    part 100 eval python3 -m moebalance.cli eval "$run"
    part 120 generate python3 -m moebalance.cli generate "$run" --prompt "def parse(" \
        --max-new-tokens 40
    part 100 export python3 -m moebalance.cli export "$run" "$OUT/hf"
    ls -l "$OUT/hf" | log
    rm -rf "$OUT/hf" "$OUT/smoke/checkpoints"  # not brought back
    ;;
ab)
    # each run through benchmarks/program_log.py: its programs' tracing, lowering and compile (or
    # cache load) times in $OUT/programs-1.json (and -2.json, the warm run)
    # (epoch seconds before and after each process, beside those it reports of its own start and
    # end, say how long the interpreter took to start and to exit)
    start=$SECONDS
    echo "process 1 from $(date +%s.%N)" | log
    part 300 ab python3 benchmarks/program_log.py --json "$OUT/programs-1.json" -- \
        ab deepseek4-tiny ${AB_OVERRIDES:-} --out "$OUT/ab"
    echo "process 1 to $(date +%s.%N)" | log
    times=$((SECONDS - start))
    if [ "${2:-}" = twice ]; then
        start=$SECONDS
        echo "process 2 from $(date +%s.%N)" | log
        part 200 ab python3 benchmarks/program_log.py --json "$OUT/programs-2.json" -- \
            ab deepseek4-tiny ${AB_OVERRIDES:-} --out "$OUT/ab" --overwrite
        echo "process 2 to $(date +%s.%N)" | log
        times="$times $((SECONDS - start))"
    fi
    python3 benchmarks/tpu_record.py ab "$RECORD" "$OUT/ab" "$(date +%F)" $times 2>&1 | log
    # back from the device: the table and Run B's steps (their times), not the runs' folders
    cp "$OUT/ab/table.json" "$OUT/table.json"
    cp "$OUT/ab/run_b/metrics.jsonl" "$OUT/metrics-b.jsonl"
    rm -rf /tmp/ab && mv "$OUT/ab" /tmp/ab  # kept on the machine for `cli`
    ;;
*)
    echo "usage: bash benchmarks/tpu.sh [step|remat|experts|profile|peer|ab [twice]|speed|goals" \
        "|d1024 B A [key=value ...]" \
        "|lowering|startup|abprofile|cli|study [ARGS]|functions|tests [FILES]]" >&2
    exit 2
    ;;
esac
cat "$RECORD" 2>/dev/null
