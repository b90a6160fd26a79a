# Ray cluster start / stop for recipes/<model>/launch.sh. Sourced, not run; the launcher calls
# `rc_main RECIPE_DIR "$@"`, which:
#   1. prints the usage and exits 2 without MODEL_DIR, before anything touches Ray;
#   2. reads RECIPE_DIR/cluster.env and runs `python -m asyncflow.recipes_check` on the config with the same
#      overrides (config vs model vs devices);
#   3. takes the hosts from Slurm ($SLURM_JOB_NODELIST) or from HOSTS="a b c" (ssh);
#   4. starts one `ray start --block` per host, the head on this machine (the driver needs a local Ray
#      node), in a private temp dir and port, records each process it starts, and waits until the
#      cluster has NODES x DEVICES_PER_NODE devices;
#   5. runs `asyncflow train RECIPE_DIR/config.yaml model.path=$MODEL_DIR ray.address=HEAD:PORT [overrides]
#      observability.output_dir=ABS [checkpoint.dir=ABS] [--resume]`: the run's roots as absolute paths, since a
#      relative one would resolve on each node against that node's own working directory;
#   6. on any exit (end, error, Ctrl-C, scancel / SIGTERM) stops only what it started: SIGTERM to the
#      training driver, which then has TRAIN_STOP_GRACE_S to checkpoint and exit (the launcher exits with the
#      driver's code, so the sbatch template sees 75 and requeues), then to each recorded `ray start --block`,
#      which stops the raylet / GCS it spawned.
#      No `ray stop` (it stops every Ray of this user on the node, other jobs included) and no pkill.
# Containers: EXEC_PREFIX (words put before every python / ray / asyncflow command on this node, e.g.
# `apptainer exec --nv IMAGE`) and REMOTE_EXEC_PREFIX (the same on the other nodes; default EXEC_PREFIX).
# NET_IF names the network interface of the run: Ray's node addresses (and so the TransferQueue's and the
# weight relay's), NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME all follow it.
# shellcheck shell=bash
# shellcheck source=recipes/common/wait_child.sh
source "$(dirname "${BASH_SOURCE[0]}")/wait_child.sh"

rc_log() { echo "launch[$RC_NAME]: $*" >&2; }
rc_die() { echo "launch[$RC_NAME]: error: $*" >&2; exit 2; }

rc_usage() {
    cat >&2 <<EOF
usage: MODEL_DIR=/path/to/checkpoint [HOSTS="host1 host2 ..."] bash recipes/$RC_NAME/launch.sh [--resume] [section.key=value ...]

Starts a Ray cluster of $NODES node(s) x $DEVICES_PER_NODE $DEVICE_RESOURCE (recipes/$RC_NAME/cluster.env), then runs
  asyncflow train recipes/$RC_NAME/config.yaml model.path=\$MODEL_DIR ray.address=<head>:<port> [section.key=value ...]
and stops the Ray processes it started when training ends or the launcher is interrupted.
--resume continues from the newest complete checkpoint under checkpoint.dir (asyncflow train --resume).

Hosts: in a Slurm job (sbatch, or a shell on its first node), the allocation's nodes via srun; otherwise HOSTS,
  reached by ssh, whose first entry must be this machine (it runs the head and the driver; 'localhost' is fine).
Required: MODEL_DIR  Hugging Face checkpoint directory of the recipe's model (config.json, weights, tokenizer).
Optional: RAY_PORT (default 20000 + job id mod 20000), RAY_TMPDIR (default /tmp/af_ray_<job id>),
  RAY_WAIT_S (300), RAY_NUM_CPUS (Ray's autodetection), LAUNCH_DIR (outputs/launch/$RC_NAME-<job id>),
  PYTHON (python3), ASYNCFLOW (asyncflow), RAY_BIN (ray; the path on every host), SSH_OPTS, SRUN_EXTRA_ARGS.
  NET_IF (network interface: each node's Ray address, the TransferQueue's, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME),
  EXEC_PREFIX / REMOTE_EXEC_PREFIX (container: words before every python / ray / asyncflow command, here / on the
  other nodes), TRAIN_STOP_GRACE_S (180: how long a stopped driver may take to checkpoint and exit before SIGKILL;
  above its own checkpoint.signal_grace_s plus teardown).
Every node's Ray gets this shell's NCCL_*, GLOO_*, HF_*, CUDA_*, LD_LIBRARY_PATH and PYTHONPATH (srun passes the
  whole environment; ssh gets them on the remote command line).
EOF
}

rc_load_cluster_env() {
    [[ -f "$RC_RECIPE_DIR/cluster.env" ]] || rc_die "$RC_RECIPE_DIR/cluster.env is missing"
    # shellcheck source=/dev/null
    source "$RC_RECIPE_DIR/cluster.env"
    DEVICE_RESOURCE=${DEVICE_RESOURCE:-GPU}
    local key
    for key in NODES DEVICES_PER_NODE TRAINER_DEVICES ROLLOUT_DEVICES; do
        [[ "${!key:-}" =~ ^[1-9][0-9]*$ ]] || rc_die "$RC_RECIPE_DIR/cluster.env: $key must be a positive integer"
    done
}

rc_require_tools() {
    local tool tools=("$PYTHON" "$ASYNCFLOW" "$RAY_BIN")
    (( ${#RC_EXEC[@]} )) && tools=("${RC_EXEC[0]}")  # the AsyncFlow tools are inside the container
    for tool in "${tools[@]}" "$@"; do
        command -v "$tool" >/dev/null || rc_die "'$tool' not found on PATH (activate the AsyncFlow environment)"
    done
}

# RC_HOSTS: the first NODES hosts; RC_MODE: slurm or ssh.
rc_hosts() {
    local all=()
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        RC_MODE=slurm
        rc_require_tools srun scontrol
        mapfile -t all < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    elif [[ -n "${HOSTS:-}" ]]; then
        RC_MODE=ssh
        read -r -a all <<<"$HOSTS"
    else
        rc_die "no hosts: run inside a Slurm allocation or set HOSTS=\"host1 host2 ...\""
    fi
    (( ${#all[@]} >= NODES )) || rc_die "$RC_NAME needs NODES=$NODES hosts, got ${#all[@]}: ${all[*]}"
    RC_HOSTS=("${all[@]:0:NODES}")
    rc_is_this_host "${RC_HOSTS[0]}" || rc_die "the first host ${RC_HOSTS[0]} must be this machine" \
        "($(hostname)): it runs the Ray head and the training driver; start the launcher there"
}

rc_is_this_host() {
    [[ "$1" == localhost || "$1" == 127.0.0.1 || "$1" == "$(hostname)" || "$1" == "$(hostname -s)" ||
       "$1" == "$(hostname -f 2>/dev/null)" ]]
}

rc_ssh() {  # host command...: run a short command on a host over ssh
    local host=$1; shift
    # shellcheck disable=SC2086,SC2029  # SSH_OPTS splits into options; the command is quoted here on purpose
    ssh $SSH_OPTS "$host" "$(printf '%q ' "$@")"
}

# The environment every node's Ray (and so every worker on it) needs from this shell: network interfaces and
# tuning of NCCL and gloo, the Hugging Face cache and offline switches, device selection and library paths.
# srun passes the whole environment (--export=ALL); over ssh these go as VAR=value words before the command.
rc_forwarded_env() {  # prints `VAR=value` words, each quoted for the remote shell
    local name
    while IFS= read -r name; do
        if [[ $name =~ ^(NCCL_|GLOO_|HF_|CUDA_)[A-Za-z0-9_]*$ || $name == LD_LIBRARY_PATH || $name == PYTHONPATH ]]; then
            printf '%s=%q ' "$name" "${!name}"
        fi
    done < <(compgen -e | sort)
}

# Run on a node: find the IPv4 address of interface $0 there and append it to the command "$@" as Ray's
# --node-ip-address (outside any container: `ip` is the host's).
# shellcheck disable=SC2016  # expanded by the remote bash, not here
RC_NODE_IP_SH='ip=$(ip -4 -o addr show dev "$0" | awk "{print \$4}" | cut -d/ -f1 | head -n 1); '\
'[ -n "$ip" ] || { echo "no IPv4 address on network interface $0 (NET_IF) on $(hostname)" >&2; exit 2; }; '\
'exec "$@" --node-ip-address="$ip"'

rc_if_address() {  # the IPv4 address of network interface $1 on this machine
    ip -4 -o addr show dev "$1" 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -n 1
}

# Start `ray start --block ARGS` on a host and record what must be signalled to stop it.
rc_start_ray() {
    local host=$1 index=$2; shift 2
    local log="$LAUNCH_DIR/ray-$index-$host.log" pid
    local cmd=("$RAY_BIN" start --block --temp-dir="$RAY_TMPDIR" --disable-usage-stats
               --dashboard-agent-listen-port=$((RAY_PORT + 2)) "$(rc_device_arg)" "$@")
    [[ -n "${RAY_NUM_CPUS:-}" ]] && cmd+=(--num-cpus="$RAY_NUM_CPUS")
    if rc_is_this_host "$host"; then
        cmd=("${RC_EXEC[@]}" "${cmd[@]}")
    else
        cmd=("${RC_REMOTE_EXEC[@]}" "${cmd[@]}")
        [[ -n "${NET_IF:-}" ]] && cmd=(bash -c "$RC_NODE_IP_SH" "$NET_IF" "${cmd[@]}")
    fi
    # Each in a session of its own (setsid; in this non-interactive shell it keeps the pid): a SIGINT or SIGTERM
    # to the launcher's process group (Ctrl-C, scancel, a preemption) must not stop Ray under the driver while it
    # checkpoints; the cleanup stops these processes by their recorded pids once the driver is done.
    if rc_is_this_host "$host"; then
        setsid "${cmd[@]}" >"$log" 2>&1 </dev/null &
        pid=$!; echo "local $host $pid" >>"$LAUNCH_DIR/started.txt"
    elif [[ $RC_MODE == slurm ]]; then
        # srun forwards SIGTERM to the remote `ray start --block`; the job step ends with it.
        # shellcheck disable=SC2086
        setsid srun --nodes=1 --ntasks=1 -w "$host" --export=ALL $SRUN_EXTRA_ARGS "${cmd[@]}" >"$log" 2>&1 \
            </dev/null &
        pid=$!; echo "local $host $pid" >>"$LAUNCH_DIR/started.txt"
    else
        local tmp token_env
        token_env="RAY_AUTH_MODE=$RAY_AUTH_MODE $(rc_forwarded_env)"
        tmp=$(printf '%q' "$RAY_TMPDIR")
        if [[ $RAY_AUTH_MODE == token ]]; then  # the token goes through stdin, never on a command line
            # shellcheck disable=SC2086,SC2029
            ssh $SSH_OPTS "$host" "mkdir -p $tmp && umask 077 && cat >$tmp/auth_token" <<<"$RAY_AUTH_TOKEN" ||
                rc_die "could not reach $host over ssh"
            token_env+=" RAY_AUTH_TOKEN_PATH=$tmp/auth_token"
        fi
        # Only `nohup ray start` goes to the background, its output to a file: ssh returns once `echo` is done.
        # shellcheck disable=SC2086,SC2029
        pid=$(ssh $SSH_OPTS "$host" "mkdir -p $tmp; $token_env nohup $(printf '%q ' "${cmd[@]}")" \
            ">$tmp/ray_start.log 2>&1 </dev/null & echo \$!")
        [[ "$pid" =~ ^[0-9]+$ ]] || rc_die "could not start Ray on $host over ssh (got '$pid')"
        echo "ssh $host $pid" >>"$LAUNCH_DIR/started.txt"
        log="$host:$RAY_TMPDIR/ray_start.log"
    fi
    rc_log "started ray on $host (pid $pid, log $log)"
}

rc_device_arg() {
    if [[ $DEVICE_RESOURCE == GPU ]]; then
        echo "--num-gpus=$DEVICES_PER_NODE"
    else
        echo "--resources={\"$DEVICE_RESOURCE\": $DEVICES_PER_NODE}"
    fi
}

rc_head_ip() {  # this machine's address for the other nodes (not the 127.0.1.1 of some /etc/hosts)
    local ip
    if [[ -n "${NET_IF:-}" ]]; then
        ip=$(rc_if_address "$NET_IF")
        [[ -n "$ip" ]] || rc_die "NET_IF=$NET_IF: this machine ($(hostname)) has no IPv4 address on that interface" \
            "(see \`ip -4 addr\`)"
        echo "$ip"; return
    fi
    ip=$(hostname --ip-address 2>/dev/null | awk '{print $1}')
    [[ -z "$ip" || "$ip" == 127.* ]] && ip=$(hostname -I 2>/dev/null | awk '{print $1}')
    echo "$ip"
}

rc_auth() {
    # Ray >= 2.5x turns token authentication on for `ray start --head` when ~/.ray/auth_token exists, while a
    # driver given an explicit address sends a token only under RAY_AUTH_MODE=token. One fresh token per launch,
    # in the environment of every process it starts (srun passes the environment on; ssh gets a file).
    export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
    if [[ $RAY_AUTH_MODE == token && -z "${RAY_AUTH_TOKEN:-}" ]]; then
        RAY_AUTH_TOKEN=$("${RC_EXEC[@]}" "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
        export RAY_AUTH_TOKEN
    fi
}

rc_start_cluster() {
    local i
    HEAD_IP=${HEAD_IP:-$(rc_head_ip)}
    [[ -n "$HEAD_IP" ]] || rc_die "could not find this machine's IP address (set HEAD_IP)"
    RC_ADDRESS="$HEAD_IP:$RAY_PORT"
    rc_auth
    rc_start_ray "${RC_HOSTS[0]}" 0 --head --port="$RAY_PORT" --node-ip-address="$HEAD_IP" \
        --include-dashboard=false --ray-client-server-port=$((RAY_PORT + 1)) --dashboard-port=$((RAY_PORT + 3))
    for ((i = 1; i < NODES; i++)); do
        rc_start_ray "${RC_HOSTS[i]}" "$i" --address="$RC_ADDRESS"
    done
}

# Wait for NODES x DEVICES_PER_NODE devices; record the Ray node IDs of the cluster.
rc_wait_for_devices() {
    local want=$((NODES * DEVICES_PER_NODE))
    rc_log "waiting up to ${RAY_WAIT_S}s for $want $DEVICE_RESOURCE on $NODES node(s) at $RC_ADDRESS"
    "${RC_EXEC[@]}" "$PYTHON" - "$RC_ADDRESS" "$DEVICE_RESOURCE" "$want" "$NODES" "$RAY_WAIT_S" \
        "$LAUNCH_DIR/ray_nodes.txt" <<'EOF'
import sys
import time

address, resource, want, nodes, wait_s, out = sys.argv[1:]
deadline = time.time() + float(wait_s)
import ray  # noqa: E402

while True:  # the head may still be starting: retry the connection itself too
    try:
        ray.init(address=address, namespace="asyncflow-launch", log_to_driver=False)
        break
    except Exception as exc:  # ConnectionError, or a RuntimeError while the GCS comes up
        if time.time() > deadline:
            sys.exit(f"no Ray head at {address} after {wait_s}s: {exc}")
        time.sleep(2)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    have = sum(n["Resources"].get(resource, 0) for n in alive)
    if have >= int(want) and len(alive) >= int(nodes):
        break
    if time.time() > deadline:
        sys.exit(f"after {wait_s}s the cluster has {len(alive)} node(s) and {have:g} {resource}, "
                 f"expected {nodes} and {want}; see the ray-*.log files")
    time.sleep(2)
with open(out, "w") as f:
    for n in alive:
        f.write(f"{n['NodeID']} {n['NodeManagerAddress']} {n['Resources'].get(resource, 0):g}\n")
print(f"cluster ready: {len(alive)} node(s), {have:g} {resource}")
EOF
}

rc_signal() {  # mode host signal pid; fails when the process is gone
    if [[ $1 == local ]]; then kill "-$3" "$4" 2>/dev/null; else rc_ssh "$2" kill "-$3" "$4" 2>/dev/null; fi
}

# "mode host pid" lines on stdin: SIGTERM to all, GRACE seconds (30) for all to exit, then SIGKILL to those
# pids; returns 1 when one needed SIGKILL.
rc_stop() {
    local grace=${1:-30} entries=() entry mode host pid left
    mapfile -t entries
    for entry in "${entries[@]}"; do
        read -r mode host pid <<<"$entry"
        rc_signal "$mode" "$host" TERM "$pid" || true
    done
    for _ in $(seq "$grace"); do
        left=0
        for entry in "${entries[@]}"; do
            read -r mode host pid <<<"$entry"
            rc_signal "$mode" "$host" 0 "$pid" && left=1
        done
        (( left )) || return 0
        sleep 1
    done
    for entry in "${entries[@]}"; do
        read -r mode host pid <<<"$entry"
        rc_signal "$mode" "$host" 0 "$pid" || continue
        rc_log "pid $pid on $host ignored SIGTERM for $grace s; sending SIGKILL to that pid"
        rc_signal "$mode" "$host" KILL "$pid" || true
    done
    return 1
}

# The INT and TERM traps until the driver starts: ignore further signals at once (a second one, e.g. scancel's to the
# process group and then the batch script's, would otherwise end the cleanup half-way and leave Ray running), then
# exit through rc_cleanup.
rc_stopping() {
    trap '' INT TERM
    exit "$1"
}

# The INT and TERM traps while the driver runs. The driver checkpoints at its next step boundary and exits (75 after
# a signal, see docs/fault_tolerance.md); it may have had the signal itself (Ctrl-C, scancel and preemptions signal
# the whole process group). rc_wait_for_driver collects its code; a watchdog sends SIGKILL after the grace time.
rc_on_signal() {
    trap '' INT TERM
    RC_SIGNALLED=$1
    rc_log "stopping the training driver (pid $RC_TRAIN_PID; up to ${TRAIN_STOP_GRACE_S}s to checkpoint)"
    kill -TERM "$RC_TRAIN_PID" 2>/dev/null || true
    (
        for _ in $(seq "$TRAIN_STOP_GRACE_S"); do
            kill -0 "$RC_TRAIN_PID" 2>/dev/null || exit 0
            sleep 1 </dev/null >/dev/null 2>&1
        done
        rc_log "the driver (pid $RC_TRAIN_PID) ignored SIGTERM for $TRAIN_STOP_GRACE_S s; sending SIGKILL"
        kill -KILL "$RC_TRAIN_PID" 2>/dev/null
    ) &
}

# Wait for the driver; return its code, which becomes the launcher's (the sbatch template requeues on 75). Polled
# (wait_child.sh): a trap runs at once, and the driver's code is not lost to it.
rc_wait_for_driver() {
    local code=0
    TMPDIR=$LAUNCH_DIR wait_child "$RC_TRAIN_PID" || code=$?
    RC_TRAIN_DONE=1
    (( code == 0 )) || rc_log "the training driver exited with code $code"
    return "$code"
}

rc_cleanup() {
    local status=$?
    # Ignore further signals while stopping (scancel and `timeout` signal the whole process group, this
    # cleanup's own subshells included); the recorded processes are stopped below, one by one.
    trap - EXIT
    trap '' INT TERM
    set +e
    if [[ -n "${RC_TRAIN_PID:-}" && -z "${RC_TRAIN_DONE:-}" ]]; then
        # The launcher fails while the driver runs: stop the driver the same way (its code becomes the launcher's).
        local killed=0 code
        if kill -0 "$RC_TRAIN_PID" 2>/dev/null; then
            rc_log "stopping the training driver (pid $RC_TRAIN_PID; up to ${TRAIN_STOP_GRACE_S}s to checkpoint)"
            echo "local localhost $RC_TRAIN_PID" | rc_stop "$TRAIN_STOP_GRACE_S" || killed=1
        fi
        if (( ! killed )); then
            wait "$RC_TRAIN_PID"
            code=$?  # 127: its code was already collected (the run ended on its own)
            if (( code != 127 )); then
                status=$code
                rc_log "the training driver exited with code $status"
            fi
        fi
    fi
    if [[ -s "$LAUNCH_DIR/started.txt" ]]; then
        tac "$LAUNCH_DIR/started.txt" | rc_stop  # workers first, the head last; only what this launcher recorded
        rc_log "stopped the Ray processes it started (listed in $LAUNCH_DIR/started.txt)"
    fi
    # The temp dir this launcher made goes too, if Ray left nothing in it (its logs stay where it did).
    [[ -n "${RC_MADE_TMPDIR:-}" ]] && rmdir "$RAY_TMPDIR" 2>/dev/null
    exit "$status"
}

# RC_OVERRIDES: the section.key=value arguments; RC_RESUME: (--resume) or ().
rc_parse_args() {
    RC_OVERRIDES=() RC_RESUME=()
    local arg
    for arg in "$@"; do
        case "$arg" in
            -h | --help) rc_usage; exit 0 ;;
            --resume) RC_RESUME=(--resume) ;;
            -*) rc_die "unknown option $arg (options: --resume, --help; then section.key=value overrides)" ;;
            *) RC_OVERRIDES+=("$arg") ;;
        esac
    done
}

# RC_ROOTS: overrides that set the run's output and checkpoint roots (config + overrides) to absolute paths,
# resolved here: the driver and every worker, on any node, then write to the same (shared) place.
rc_absolute_roots() {
    mapfile -t RC_ROOTS < <("${RC_EXEC[@]}" "$PYTHON" - "$RC_RECIPE_DIR/config.yaml" "${RC_OVERRIDES[@]}" <<'EOF'
import os
import sys

from asyncflow.config import load_config

cfg = load_config(sys.argv[1], sys.argv[2:])
print(f"observability.output_dir={os.path.abspath(cfg.observability.output_dir)}")
if cfg.checkpoint.dir:
    print(f"checkpoint.dir={os.path.abspath(cfg.checkpoint.dir)}")
EOF
    )
    (( ${#RC_ROOTS[@]} )) || rc_die "could not read the output and checkpoint roots of $RC_RECIPE_DIR/config.yaml"
}

rc_main() {
    RC_RECIPE_DIR=$(cd "$1" && pwd); shift
    RC_NAME=$(basename "$RC_RECIPE_DIR")
    rc_load_cluster_env
    rc_parse_args "$@"
    if [[ -z "${MODEL_DIR:-}" ]]; then
        rc_usage
        rc_die "MODEL_DIR is not set: the Hugging Face checkpoint directory of the recipe's model"
    fi
    [[ -f "$MODEL_DIR/config.json" ]] || rc_die "MODEL_DIR=$MODEL_DIR has no config.json"
    local job=${SLURM_JOB_ID:-$$}
    PYTHON=${PYTHON:-python3} ASYNCFLOW=${ASYNCFLOW:-asyncflow} RAY_BIN=${RAY_BIN:-ray}
    RAY_PORT=${RAY_PORT:-$((20000 + job % 20000))} RAY_WAIT_S=${RAY_WAIT_S:-300}
    RAY_TMPDIR=${RAY_TMPDIR:-/tmp/af_ray_$job} LAUNCH_DIR=${LAUNCH_DIR:-outputs/launch/$RC_NAME-$job}
    SSH_OPTS=${SSH_OPTS:--o BatchMode=yes} SRUN_EXTRA_ARGS=${SRUN_EXTRA_ARGS:-}
    TRAIN_STOP_GRACE_S=${TRAIN_STOP_GRACE_S:-180}
    # Word lists (container commands); a path with spaces cannot be given here.
    read -r -a RC_EXEC <<<"${EXEC_PREFIX:-}"
    read -r -a RC_REMOTE_EXEC <<<"${REMOTE_EXEC_PREFIX-${EXEC_PREFIX:-}}"
    if [[ -n "${NET_IF:-}" ]]; then  # one interface for every transport of the run
        export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$NET_IF} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NET_IF}
    fi
    rc_require_tools
    "${RC_EXEC[@]}" "$PYTHON" -m asyncflow.recipes_check "$RC_RECIPE_DIR" --model-dir "$MODEL_DIR" "${RC_OVERRIDES[@]}" ||
        rc_die "recipe check failed (messages above); nothing was started"
    rc_absolute_roots
    rc_hosts
    [[ -d "$RAY_TMPDIR" ]] || RC_MADE_TMPDIR=1
    mkdir -p "$LAUNCH_DIR" "$RAY_TMPDIR"
    : >"$LAUNCH_DIR/started.txt"
    trap rc_cleanup EXIT
    trap 'rc_stopping 130' INT
    trap 'rc_stopping 143' TERM
    rc_log "$RC_MODE: ${RC_HOSTS[*]}; trainer $TRAINER_DEVICES + rollout $ROLLOUT_DEVICES of" \
        "$((NODES * DEVICES_PER_NODE)) $DEVICE_RESOURCE; records in $LAUNCH_DIR"
    rc_start_cluster
    rc_wait_for_devices
    # In the background so that a signal to this script reaches the trap at once (bash defers traps while
    # a foreground child runs); the trap then stops the driver by its recorded pid. A signal that comes between
    # the driver's start and the record of its pid is held until the record exists: taken at once, the cleanup
    # would not know the driver, and its exit code (75 after a checkpoint) would be lost.
    local held=""
    trap 'held=130' INT
    trap 'held=143' TERM
    "${RC_EXEC[@]}" "$ASYNCFLOW" train "$RC_RECIPE_DIR/config.yaml" model.path="$MODEL_DIR" ray.address="$RC_ADDRESS" \
        "${RC_OVERRIDES[@]}" "${RC_ROOTS[@]}" "${RC_RESUME[@]}" &
    RC_TRAIN_PID=$!
    echo "$RC_TRAIN_PID" >"$LAUNCH_DIR/train.pid"
    trap 'rc_on_signal 130' INT
    trap 'rc_on_signal 143' TERM
    [[ -z "$held" ]] || rc_on_signal "$held"
    rc_wait_for_driver
}
