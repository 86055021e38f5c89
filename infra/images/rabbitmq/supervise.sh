#!/bin/sh
# PID 1 of the RabbitMQ image: runs the broker and starts it again when it dies, so a broker killed
# with SIGKILL (infra/harness/services.py: kill_rabbitmq) comes back in the same container, at the same
# address, with the same node name and data directory. SIGTERM or SIGINT (a container stop) stops the
# broker cleanly and ends this script with the broker's status. At most RABBITMQ_MAX_RESTARTS restarts.
set -u
max_restarts=${RABBITMQ_MAX_RESTARTS:-10}
# The nodes of a cluster share one Erlang cookie (VIDX_ERLANG_COOKIE), written where the broker and its
# CLI tools (rabbitmqctl, which runs as the rabbitmq user) read it; never echoed.
if [ -n "${VIDX_ERLANG_COOKIE:-}" ]; then
  cookie=/var/lib/rabbitmq/.erlang.cookie
  (umask 077 && printf '%s' "$VIDX_ERLANG_COOKIE" >"$cookie")
  chown rabbitmq:rabbitmq "$cookie" && chmod 400 "$cookie"
fi
restart_delay_s=${RABBITMQ_RESTART_DELAY_S:-1}
restarts=0
stopping=0
child=0

stop() {
  stopping=1
  if [ "$child" -gt 0 ]; then kill -TERM "$child" 2>/dev/null; fi
}
trap stop TERM INT

while :; do
  # setpriv execs (su would stay in between and SIGKILL the broker 2 s after a SIGTERM): the child is
  # the broker's own start script, which answers SIGTERM by stopping the node (rabbitmqctl stop).
  (cd /var/lib/rabbitmq && HOME=/var/lib/rabbitmq USER=rabbitmq LOGNAME=rabbitmq \
    exec setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmq-server) &
  child=$!
  # wait returns early when a trapped signal arrives; wait again until the broker is gone.
  while :; do
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break
  done
  child=0
  if [ "$stopping" = 1 ]; then
    exit "$status"
  fi
  if [ "$restarts" -ge "$max_restarts" ]; then
    echo "supervise: rabbitmq-server exited ($status) after $restarts restarts; giving up" >&2
    exit "$status"
  fi
  restarts=$((restarts + 1))
  echo "supervise: rabbitmq-server exited ($status); restart $restarts of $max_restarts" >&2
  sleep "$restart_delay_s"
done
