# wait_child PID: wait for a child of this shell and return its exit code, by polling. Sourced by
# recipes/common/ray_cluster.sh (the driver) and recipes/slurm/asyncflow.sbatch (the launcher).
# Not one blocking `wait`: a trap that runs while bash waits for a child can lose that child's exit status when the
# child exits meanwhile (bash 5.2: a later `wait` for it never returns). A builtin `read` with a timeout on a FIFO
# of its own is the poll's clock: no child process, and a trap runs at once.
# shellcheck shell=bash

wait_child() {
    local pid=$1 fifo tick code=0
    fifo=$(mktemp -u "${TMPDIR:-/tmp}/asyncflow-wait.XXXXXX")
    mkfifo "$fifo"
    exec {tick}<>"$fifo"
    rm -f "$fifo"
    while kill -0 "$pid" 2>/dev/null; do
        read -rt 0.5 -u "$tick" _ || true
    done
    exec {tick}<&-
    wait "$pid" || code=$?
    return "$code"
}
