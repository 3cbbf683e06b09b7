#!/usr/bin/env bash
# End-to-end check of several sandgate instances on one PostgreSQL database.
#
# One database created for the run (sandgate_mic_<random>, dropped at exit), `sandgate
# migrate`, one shared secret, instances A and B (each with its own --node-url), one real
# worker dialing A through a TCP forwarder this script controls (tests/faultproxy.py run as a
# script, the tests' one fault proxy), so the worker can be moved to B without restarting it,
# which would kill its sandboxes; the same checks run as pytest in
# tests/e2e/test_multi_instance_moves.py. An instance C with
# SANDGATE_FAULTS=skip-delivery and an instance D with SANDGATE_FAULTS=exit-after-accept.
# Prints `ok: <what>` per check; exits non-zero with `FAIL: <what>` on the first failure.
#
#   SANDGATE_MIC_PG_DSN   a PostgreSQL server where the run may create a database
#                         (default: $SANDGATE_TEST_PG_DSN, else
#                         postgresql://postgres@127.0.0.1:5432/test)
#   SANDGATE_MIC_RUNTIME  the worker's runtime (default bwrap; needs root)
#   SANDGATE_MIC_KEEP=1   keep the state dir (logs) after the run
set -euo pipefail
cd "$(dirname "$0")/.."

SG=$PWD/.venv/bin/sandgate
PY=$PWD/.venv/bin/python
ADMIN_DSN=${SANDGATE_MIC_PG_DSN:-${SANDGATE_TEST_PG_DSN:-postgresql://postgres@127.0.0.1:5432/test}}
RUNTIME=${SANDGATE_MIC_RUNTIME:-bwrap}
RUN=$(python3 -c 'import secrets; print(secrets.token_hex(4))')
DB=sandgate_mic_$RUN
STATE=/var/lib/sandgate-mic-$RUN
SERVER_BASE=${ADMIN_DSN%%\?*}     # drop a query string
SERVER_BASE=${SERVER_BASE%/*}     # drop the database
DB_URL=$SERVER_BASE/$DB
OWNER_TTL=90
RECOVERY_AFTER=5
RECOVERY_INTERVAL=1
START_ALLOWANCE=5   # seconds a recovered delivery may take to start the sandbox
T0=$SECONDS

declare -A PIDS=()   # role -> pid of every process this script started
DB_CREATED=0

log() { printf '%s\n' "$*"; }
ok() { printf 'ok: %s\n' "$*"; }

dump_logs() {
  local f
  for f in "$STATE"/logs/*.log; do
    [ -f "$f" ] || continue
    printf '\n--- %s (tail) ---\n' "$(basename "$f")" >&2
    tail -n 30 "$f" >&2 || true
  done
}

fail() {
  printf 'FAIL: %s\n' "$*" >&2
  [ -n "${LAST_BODY:-}" ] && [ -f "$LAST_BODY" ] && { printf 'last response: %s %s\n' "${STATUS:-}" "$(head -c 2000 "$LAST_BODY")" >&2; } || true
  dump_logs
  exit 1
}

stop_pid() {  # stop_pid PID SIGNAL: signal it, wait up to 15 s, then SIGKILL
  local pid=$1 sig=${2:-TERM} i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -CONT "$pid" 2>/dev/null || true
  kill -"$sig" "$pid" 2>/dev/null || true
  for i in $(seq 1 150); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$? role
  set +e
  trap - EXIT INT TERM
  # the worker first: it destroys the sandboxes it runs
  [ -n "${PIDS[worker]:-}" ] && stop_pid "${PIDS[worker]}" TERM
  for role in "${!PIDS[@]}"; do
    stop_pid "${PIDS[$role]}" TERM
  done
  if [ "$DB_CREATED" = 1 ]; then
    psql "$ADMIN_DSN" -qAt -v ON_ERROR_STOP=1 \
      -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 \
      || printf 'warning: could not drop database %s\n' "$DB" >&2
  fi
  if [ "${SANDGATE_MIC_KEEP:-0}" = 1 ]; then
    printf 'kept %s\n' "$STATE" >&2
  else
    rm -rf "$STATE"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# -- HTTP helpers --------------------------------------------------------------------------
# api METHOD URL [curl args...]: sets STATUS, BODY (text), HEADERS (file); never fails itself
REQ=0
api() {
  local method=$1 url=$2
  shift 2
  REQ=$((REQ + 1))
  LAST_BODY=$STATE/http/$REQ.body
  HEADERS=$STATE/http/$REQ.headers
  STATUS=$(curl -sS -o "$LAST_BODY" -D "$HEADERS" -w '%{http_code}' -X "$method" \
    --max-time "${CURL_MAX_TIME:-90}" -H "Authorization: Bearer $KEY" "$@" "$url" 2>"$STATE/http/$REQ.err") \
    || STATUS="curl-exit-$?"
  BODY=$(cat "$LAST_BODY" 2>/dev/null || true)
}

jfield() {  # jfield EXPR: evaluate EXPR on the last JSON body as `d`
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); v=eval(sys.argv[2]); print(v if not isinstance(v,(dict,list)) else json.dumps(v))' \
    "$LAST_BODY" "$1" 2>/dev/null || true
}

header() {  # header NAME: value of a response header of the last request ('' if absent)
  tr -d '\r' <"$HEADERS" | awk -v h="$(printf '%s' "$1" | tr 'A-Z' 'a-z')" \
    'BEGIN{FS=": "} tolower($1)==h {v=substr($0, length($1)+3)} END{print v}'
}

create() {  # create URL BODY [curl args...]
  local url=$1 body=$2
  shift 2
  api POST "$url/api/v1/sandboxes" -H 'Content-Type: application/json' -d "$body" "$@"
}

execute() {  # execute URL NAME CODE
  api POST "$1/api/v1/sandboxes/$2/execute" -H 'Content-Type: application/json' \
    -d "$(python3 -c 'import json,sys; print(json.dumps({"language":"bash","code":sys.argv[1]}))' "$3")"
}

expect_exec_ok() {  # expect_exec_ok URL NAME WHAT
  execute "$1" "$2" 'echo ok'
  [ "$STATUS" = 200 ] || fail "$3: execute answered $STATUS"
  [ "$(jfield 'd["stdout"]')" = ok ] || fail "$3: execute printed $(jfield 'd["stdout"]')"
}

sandbox_state() {  # sandbox_state URL NAME
  api GET "$1/api/v1/sandboxes/$2"
  [ "$STATUS" = 200 ] && jfield 'd["state"]' || echo "http-$STATUS"
}

wait_state() {  # wait_state URL NAME STATE TIMEOUT: 0 when reached
  local deadline=$((SECONDS + $4)) state
  while :; do
    state=$(sandbox_state "$1" "$2")
    [ "$state" = "$3" ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

find_by_meta() {  # find_by_meta URL KEY VALUE: names of sandboxes (any state but deleted)
  api GET "$1/api/v1/sandboxes?metadata.$2=$3&limit=100"
  [ "$STATUS" = 200 ] || fail "list by metadata.$2 answered $STATUS"
  jfield '" ".join(s["name"] for s in d["sandboxes"])'
}

sql() { psql "$DB_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }

wait_healthy() {  # wait_healthy URL ROLE
  local i
  for i in $(seq 1 300); do
    curl -sf --max-time 1 "$1/healthz" >/dev/null 2>&1 && return 0
    kill -0 "${PIDS[$2]}" 2>/dev/null || fail "instance $2 exited at start (see its log)"
    sleep 0.1
  done
  fail "instance $2 not healthy within 30 s"
}

# -- processes -----------------------------------------------------------------------------
start_instance() {  # start_instance ROLE PORT [FAULTS]
  local role=$1 port=$2 faults=${3:-}
  env ${faults:+SANDGATE_FAULTS=$faults} "$SG" server --db "$DB_URL" --port "$port" \
    --node-url "http://127.0.0.1:$port" --secret-file "$STATE/secret" \
    --owner-ttl "$OWNER_TTL" --recovery-after "$RECOVERY_AFTER" \
    --recovery-interval "$RECOVERY_INTERVAL" --start-timeout 30 \
    >>"$STATE/logs/server-$role.log" 2>&1 &
  PIDS[$role]=$!
  wait_healthy "http://127.0.0.1:$port" "$role"
}

start_forwarder() {  # start_forwarder TARGET_PORT: 127.0.0.1:$PORT_F -> 127.0.0.1:TARGET_PORT
  # stopping it (SIGTERM) resets every connection through it
  "$PY" tests/faultproxy.py "$PORT_F" "$1" >>"$STATE/logs/forwarder.log" 2>&1 &
  PIDS[forwarder]=$!
  local i
  for i in $(seq 1 50); do
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' \
      "$PORT_F" 2>/dev/null && return 0
    sleep 0.1
  done
  fail "forwarder did not listen on $PORT_F"
}

worker_connected_on() {  # worker_connected_on URL: 0 when w1 is connected to that instance
  api GET "$1/api/v1/workers"
  [ "$STATUS" = 200 ] && [ "$(jfield 'any(w["name"]=="w1" and w["connected"] for w in d["workers"])')" = True ]
}

owner_row() { sql "select node_url || ' ' || extract(epoch from now() - updated_at)::int from tunnel_owners where tunnel_key = 'w1'"; }

worker_starts() {  # worker_starts NAME: how many times the worker logged a real start of NAME
  grep -c "sandbox.started .*sandbox='$1'" "$STATE/logs/worker.log" || true
}

# -- set up --------------------------------------------------------------------------------
command -v psql >/dev/null || { echo "FAIL: psql is missing" >&2; exit 1; }
command -v curl >/dev/null || { echo "FAIL: curl is missing" >&2; exit 1; }
[ -x "$SG" ] || { echo "FAIL: $SG is missing: run scripts/install" >&2; exit 1; }
mkdir -p "$STATE/logs" "$STATE/http" "$STATE/worker"
chmod 711 "$STATE"
log "run $RUN: database $DB, state dir $STATE, worker runtime $RUNTIME"

psql "$ADMIN_DSN" -qAt -v ON_ERROR_STOP=1 -c "CREATE DATABASE \"$DB\"" >/dev/null \
  || fail "cannot create database $DB through $ADMIN_DSN"
DB_CREATED=1
"$SG" migrate --db "$DB_URL" >>"$STATE/logs/migrate.log" 2>&1 || fail "sandgate migrate (see migrate.log)"
ok "database $DB created and migrated"

python3 -c 'import secrets; print(secrets.token_urlsafe(48))' >"$STATE/secret"
chmod 600 "$STATE/secret"
KEY=$("$SG" keys create --db "$DB_URL" --tenant mic) || fail "sandgate keys create --tenant"
TOKEN=$("$SG" keys create --db "$DB_URL" --worker --name w1) || fail "sandgate keys create --worker"

PORT_A=$(free_port); PORT_B=$(free_port); PORT_C=$(free_port); PORT_D=$(free_port); PORT_F=$(free_port)
A=http://127.0.0.1:$PORT_A; B=http://127.0.0.1:$PORT_B
C=http://127.0.0.1:$PORT_C; D=http://127.0.0.1:$PORT_D
start_instance A "$PORT_A"
start_instance B "$PORT_B"
start_instance C "$PORT_C" skip-delivery
start_instance D "$PORT_D" exit-after-accept
ok "instances up: A $A, B $B, C $C (skip-delivery), D $D (exit-after-accept)"

start_forwarder "$PORT_A"
"$SG" worker --server "http://127.0.0.1:$PORT_F" --token "$TOKEN" --name w1 \
  --runtime "$RUNTIME" --capacity 16 --state-dir "$STATE/worker" >>"$STATE/logs/worker.log" 2>&1 &
PIDS[worker]=$!
for _ in $(seq 1 200); do
  worker_connected_on "$A" && break
  kill -0 "${PIDS[worker]}" 2>/dev/null || fail "the worker exited at start (see worker.log)"
  sleep 0.1
done
worker_connected_on "$A" || fail "worker w1 not connected to A within 20 s"
ok "worker w1 dialed A (through a forwarder on :$PORT_F)"

# -- 1. the owner row ----------------------------------------------------------------------
read -r owner age <<<"$(owner_row)" || true
[ "${owner:-}" = "$A" ] || fail "tunnel_owners row for w1 names '${owner:-nothing}', expected $A"
[ "${age:-999}" -lt 90 ] || fail "tunnel_owners row for w1 is ${age} s old (>= 90 s)"
OWNER_STAMP=$(sql "select updated_at from tunnel_owners where tunnel_key = 'w1'")
ok "owner row w1 -> $A, ${age} s old"

# -- /internal/* is for signed peers only --------------------------------------------------
for url in "$A" "$B"; do
  api POST "$url/internal/provision" -H 'Content-Type: application/json' -d '{"job_id": "x"}'
  [ "$STATUS" = 401 ] || fail "unsigned POST $url/internal/provision answered $STATUS, expected 401"
done
ok "unsigned /internal/provision is refused (401) on A and B"

# -- 2. execute on A and on B (forwarded) --------------------------------------------------
create "$A" '{"metadata": {"mic": "s1"}}'
[ "$STATUS" = 201 ] || fail "create on A answered $STATUS"
S1=$(jfield 'd["name"]')
[ "$(jfield 'd["state"]')" = running ] || fail "create on A gave state $(jfield 'd["state"]')"
execute "$A" "$S1" 'echo ok'
[ "$STATUS" = 200 ] || fail "execute on A answered $STATUS"
OUT_A=$(jfield 'd["stdout"], d["stderr"], d["exit_code"]')
execute "$B" "$S1" 'echo ok'
[ "$STATUS" = 200 ] || fail "execute on B (forwarded to A) answered $STATUS"
OUT_B=$(jfield 'd["stdout"], d["stderr"], d["exit_code"]')
[ "$OUT_A" = "$OUT_B" ] && [ "$(jfield 'd["stdout"]')" = "ok" ] \
  || fail "execute on A gave $OUT_A, on B $OUT_B"
api GET "$B/readyz"
held=$(jfield 'd.get("tunnels")')
[ -z "$held" ] || [ "$held" = 0 ] || fail "B holds $held tunnels: its execute was not forwarded"
ok "execute 'echo ok' on A and on B (forwarded) give the same output: $OUT_B"

# -- 3. a file written through B, read through A -------------------------------------------
CONTENT="mic-$RUN-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
printf '%s' "$CONTENT" >"$STATE/upload.txt"
api PUT "$B/api/v1/sandboxes/$S1/toolbox/files?path=mic.txt" --data-binary "@$STATE/upload.txt"
[ "$STATUS" = 200 ] || fail "file upload through B answered $STATUS"
api GET "$A/api/v1/sandboxes/$S1/toolbox/files?path=mic.txt"
[ "$STATUS" = 200 ] || fail "file download through A answered $STATUS"
[ "$BODY" = "$CONTENT" ] || fail "file read through A differs from the one written through B"
ok "a file written through B is read back through A"

# E2B's SDK through B, which does not hold the worker's tunnel: every envd call is forwarded
scripts/e2b-check "$B" "$KEY" >>"$STATE/logs/e2b-check.log" 2>&1 || { tail -n 40 "$STATE/logs/e2b-check.log" >&2; fail "E2B's SDK through B (see e2b-check.log)"; }
ok "E2B's Python SDK (sync and async) runs its scenario through B (forwarded to A)"

# -- 4. a create accepted by B, delivered through A ----------------------------------------
create "$B" '{"metadata": {"mic": "s2"}}'
[ "$STATUS" = 201 ] || fail "create on B answered $STATUS"
S2=$(jfield 'd["name"]')
[ "$(jfield 'd["state"]')" = running ] || fail "create on B gave state $(jfield 'd["state"]')"
[ "$(jfield 'd["worker"]')" = w1 ] || fail "create on B landed on worker $(jfield 'd["worker"]')"
[ "$(worker_starts "$S2")" = 1 ] || fail "worker logged $(worker_starts "$S2") starts of $S2, expected 1"
expect_exec_ok "$A" "$S2" "sandbox created on B, executed on A"
ok "a create accepted by B is running (delivered through A): $S2"

# -- 5. a lost delivery (C accepts and never delivers) completed by recovery ----------------
KEY_SKIP=mic-skip-$RUN
BODY_SKIP='{"metadata": {"mic": "skip"}}'
t_accept=$(date +%s.%N)
create "$C" "$BODY_SKIP" -H "Idempotency-Key: $KEY_SKIP"
[ "$STATUS" = 503 ] || fail "create on C (skip-delivery) answered $STATUS, expected 503"
[ "$(jfield 'd["error"]["code"]')" = delivery_skipped ] || fail "create on C answered code $(jfield 'd["error"]["code"]')"
[ -n "$(header Retry-After)" ] || fail "503 from C has no Retry-After"
S3=$(find_by_meta "$A" mic skip)
[ -n "$S3" ] && [ "$(wc -w <<<"$S3")" = 1 ] || fail "expected one sandbox accepted by C, found '$S3'"
state=$(sandbox_state "$A" "$S3")
[ "$state" = pending ] || fail "sandbox accepted by C is '$state' before recovery, expected pending"
# the deleted-while-pending case rides on the same recovery window
create "$C" '{"metadata": {"mic": "deleted"}}'
[ "$STATUS" = 503 ] || fail "second create on C answered $STATUS, expected 503"
S4=$(find_by_meta "$A" mic deleted)
[ -n "$S4" ] && [ "$(wc -w <<<"$S4")" = 1 ] || fail "expected one sandbox accepted by C, found '$S4'"
api DELETE "$A/api/v1/sandboxes/$S4"
[ "$STATUS" = 204 ] || fail "delete of pending $S4 on A answered $STATUS"
limit=$((RECOVERY_AFTER + RECOVERY_INTERVAL + START_ALLOWANCE))
wait_state "$A" "$S3" running "$((limit + 1))" || fail "sandbox $S3 accepted by C is '$(sandbox_state "$A" "$S3")' after $limit s"
took=$(python3 -c 'import sys,time; print(f"{time.time()-float(sys.argv[1]):.1f}")' "$t_accept")
python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)' "$took" "$limit" \
  || fail "recovery took $took s, more than --recovery-after $RECOVERY_AFTER + interval $RECOVERY_INTERVAL + start $START_ALLOWANCE"
[ "$(sql "select state from jobs where sandbox_name = '$S3' and kind = 'create'")" = completed ] \
  || fail "create job of $S3 is '$(sql "select state from jobs where sandbox_name = '$S3' and kind = 'create'")', expected completed"
[ "$(worker_starts "$S3")" = 1 ] || fail "worker logged $(worker_starts "$S3") starts of $S3, expected 1"
expect_exec_ok "$B" "$S3" "recovered sandbox, executed on B"
ok "a create accepted by C (skip-delivery) was delivered by recovery in $took s (limit $RECOVERY_AFTER + $RECOVERY_INTERVAL s + $START_ALLOWANCE s start)"

create "$B" "$BODY_SKIP" -H "Idempotency-Key: $KEY_SKIP"
[ "$STATUS" = 200 ] || fail "retry of C's create on B answered $STATUS, expected 200"
[ "$(jfield 'd["name"]')" = "$S3" ] || fail "retry of C's create on B gave $(jfield 'd["name"]'), expected $S3"
[ "$(header Idempotent-Replayed)" = true ] || fail "retry on B has no Idempotent-Replayed: true"
ok "the retry of that create on B returns the same sandbox (200, Idempotent-Replayed)"

# -- 6. deleted while pending stays deleted ------------------------------------------------
sleep "$RECOVERY_INTERVAL"   # one more loop past the window, for good measure
state=$(sandbox_state "$A" "$S4")
case "$state" in deleted | http-404) ;; *) fail "sandbox $S4 deleted while pending is now '$state' through the API" ;; esac
row=$(sql "select state from sandboxes where name = '$S4'")
case "$row" in deleted | '') ;; *) fail "sandbox $S4 deleted while pending is '$row' in the store" ;; esac
api GET "$A/api/v1/sandboxes?state=running&metadata.mic=deleted"
[ "$STATUS" = 200 ] && [ "$(jfield 'len(d["sandboxes"])')" = 0 ] || fail "a running sandbox carries the deleted one's tag"
job=$(sql "select state from jobs where sandbox_name = '$S4' and kind = 'create'")
[ "$job" = failed ] || fail "create job of deleted $S4 is '$job', expected failed"
[ "$(worker_starts "$S4")" = 0 ] || fail "the worker started the deleted sandbox $S4"
ok "a sandbox deleted while its create was pending stays deleted (job failed, never started)"

# -- 7. the owner row is renewed by heartbeats ---------------------------------------------
for _ in $(seq 1 150); do
  [ "$(sql "select updated_at > '$OWNER_STAMP' from tunnel_owners where tunnel_key = 'w1'")" = t ] && break
  sleep 0.1
done
[ "$(sql "select updated_at > '$OWNER_STAMP' from tunnel_owners where tunnel_key = 'w1'")" = t ] \
  || fail "tunnel_owners row for w1 not renewed since $OWNER_STAMP"
ok "owner row renewed by a heartbeat"

# -- 8. the accepting process dies right after its commit ----------------------------------
KEY_EXIT=mic-exit-$RUN
BODY_EXIT='{"metadata": {"mic": "exit"}}'
CURL_MAX_TIME=30 create "$D" "$BODY_EXIT" -H "Idempotency-Key: $KEY_EXIT"
case "$STATUS" in curl-exit-*) ;; *) fail "create on D (exit-after-accept) answered $STATUS, expected a dropped connection" ;; esac
for _ in $(seq 1 50); do kill -0 "${PIDS[D]}" 2>/dev/null || break; sleep 0.1; done
! kill -0 "${PIDS[D]}" 2>/dev/null || fail "instance D still runs after its exit-after-accept"
wait "${PIDS[D]}" 2>/dev/null || true
unset 'PIDS[D]'
create "$B" "$BODY_EXIT" -H "Idempotency-Key: $KEY_EXIT"
case "$STATUS" in 200 | 201) ;; *) fail "retry of D's create on B answered $STATUS" ;; esac
S5=$(jfield 'd["name"]')
[ "$(jfield 'd["state"]')" = running ] || fail "retry of D's create on B gave state $(jfield 'd["state"]')"
[ "$(find_by_meta "$A" mic exit)" = "$S5" ] || fail "sandboxes for D's create: '$(find_by_meta "$A" mic exit)', expected only $S5"
[ "$(worker_starts "$S5")" = 1 ] || fail "worker logged $(worker_starts "$S5") starts of $S5, expected 1"
ok "a create accepted by D which then died is completed once, retried through B: $S5"

# -- 9. the worker moves to B --------------------------------------------------------------
BEFORE="$S1 $S2 $S3 $S5"
stop_pid "${PIDS[forwarder]}" TERM   # drops the tunnel to A
start_forwarder "$PORT_B"            # the worker's redial now reaches B
for _ in $(seq 1 300); do
  worker_connected_on "$B" && break
  sleep 0.1
done
worker_connected_on "$B" || fail "worker w1 did not reconnect through the forwarder to B within 30 s"
for _ in $(seq 1 150); do
  read -r owner age <<<"$(owner_row)" || true
  [ "${owner:-}" = "$B" ] && break
  sleep 0.1
done
[ "${owner:-}" = "$B" ] || fail "tunnel_owners row for w1 names '${owner:-nothing}' after the move, expected $B"
kill -0 "${PIDS[worker]}" 2>/dev/null || fail "the worker died during the move"
ok "worker w1 moved to B (same process); owner row w1 -> $B"
for s in $BEFORE; do
  expect_exec_ok "$A" "$s" "sandbox $s after the move, executed on A (forwarded to B)"
done
api GET "$A/api/v1/sandboxes/$S1/toolbox/files?path=mic.txt"
[ "$STATUS" = 200 ] && [ "$BODY" = "$CONTENT" ] || fail "file read through A after the move: $STATUS"
ok "every sandbox created before the move is reachable from A: $BEFORE"

create "$A" '{"metadata": {"mic": "after-move"}}'
[ "$STATUS" = 201 ] || fail "create on A after the move answered $STATUS"
S6=$(jfield 'd["name"]')
expect_exec_ok "$A" "$S6" "sandbox created on A after the move (delivered through B)"
ok "a create accepted by A after the move is delivered through B: $S6"

log "all checks passed in $((SECONDS - T0)) s"
