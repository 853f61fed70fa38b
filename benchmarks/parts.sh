# Shared by the device scripts (accelerator.sh, tpu.sh): sourced after $OUT is made.
#   log            copies its input to the screen and $OUT/log.txt
#   part S NAME CMD...  runs CMD under a limit of S seconds, its stdout appended to
#                       $OUT/NAME.json, its stderr to the log and the screen as it comes (a
#                       part stopped at its limit still shows how far it came), so one slow
#                       part cannot take the others with it

log() { tee -a "$OUT/log.txt"; }

part() {
    local limit=$1 name=$2 start=$SECONDS
    shift 2
    echo "== $name: $* (limit ${limit} s)" | log
    timeout "$limit" "$@" 2>&1 >> "$OUT/$name.json" | tee -a "$OUT/log.txt" >&2
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | log
}
