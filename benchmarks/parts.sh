# Shared by the device scripts (accelerator.sh, tpu.sh): sourced after $OUT is made.
#   log            copies its input to the screen and $OUT/log.txt
#   part S NAME CMD...  runs CMD under a limit of S seconds, its stdout appended to
#                       $OUT/NAME.json, its stderr to the log, so one slow part cannot take
#                       the others with it

log() { tee -a "$OUT/log.txt"; }

part() {
    local limit=$1 name=$2 start=$SECONDS
    shift 2
    echo "== $name: $* (limit ${limit} s)" | log
    timeout "$limit" "$@" >> "$OUT/$name.json" 2>> "$OUT/log.txt"
    echo "== $name: exit $? after $((SECONDS - start)) s" | log
}
