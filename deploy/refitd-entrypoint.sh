#!/bin/sh
# The refitd image's entrypoint: finds this node's index (--node) and runs refitd with it and the
# container's arguments. Kubernetes pods of one DaemonSet or StatefulSet are alike, so the index
# comes from, in order:
#   REFIT_NODE       the number itself;
#   REFIT_NODE_FILE  a file holding it (the DaemonSet: /etc/refit/node-index on the host);
#   REFIT_NODE_BASE  plus the pod's ordinal, the digits after the last "-" of its hostname
#                    (a StatefulSet: engine-3 with REFIT_NODE_BASE=8 is node 11).
# None set: refitd gets no --node (its --config file or its default decides). A set one that does
# not give a number is an error (exit 2, as refitd's own flag errors).
# REFIT_TLS_DIR (the sidecar, whose index is known only here): this node's certificate is
# $REFIT_TLS_DIR/node-<N>.crt with its key node-<N>.key, passed as --tls-cert and --tls-key
# (give --tls-ca yourself); it needs a node index, and both files must be readable (exit 2).
set -eu
node=""
if [ -n "${REFIT_NODE:-}" ]; then
  node=$REFIT_NODE
elif [ -n "${REFIT_NODE_FILE:-}" ]; then
  if [ ! -r "$REFIT_NODE_FILE" ]; then
    echo "refitd-entrypoint: REFIT_NODE_FILE=$REFIT_NODE_FILE cannot be read (write this node's index there)" >&2
    exit 2
  fi
  node=$(tr -d ' \t\r\n' <"$REFIT_NODE_FILE")
elif [ -n "${REFIT_NODE_BASE:-}" ]; then
  host=$(cat /proc/sys/kernel/hostname)
  ordinal=${host##*-}
  case "$ordinal" in
    ''|*[!0-9]*) echo "refitd-entrypoint: hostname \"$host\" ends in no ordinal (REFIT_NODE_BASE is for StatefulSet pods)" >&2; exit 2 ;;
  esac
  case "$REFIT_NODE_BASE" in
    ''|*[!0-9]*) echo "refitd-entrypoint: REFIT_NODE_BASE=\"$REFIT_NODE_BASE\" is not a number" >&2; exit 2 ;;
  esac
  node=$((REFIT_NODE_BASE + ordinal))
fi
refitd=${REFITD:-/usr/local/bin/refitd}
if [ -z "$node" ]; then
  if [ -n "${REFIT_TLS_DIR:-}" ]; then
    echo "refitd-entrypoint: REFIT_TLS_DIR needs this node's index (REFIT_NODE, REFIT_NODE_FILE or REFIT_NODE_BASE)" >&2
    exit 2
  fi
  exec "$refitd" "$@"
fi
case "$node" in
  *[!0-9]*) echo "refitd-entrypoint: node index \"$node\" is not a number" >&2; exit 2 ;;
esac
if [ -n "${REFIT_TLS_DIR:-}" ]; then
  cert="$REFIT_TLS_DIR/node-$node.crt" key="$REFIT_TLS_DIR/node-$node.key"
  for f in "$cert" "$key"; do
    if [ ! -r "$f" ]; then
      echo "refitd-entrypoint: REFIT_TLS_DIR: $f cannot be read (node $node's certificate and key: docs/KUBERNETES.md, \"TLS\")" >&2
      exit 2
    fi
  done
  exec "$refitd" --node "$node" --tls-cert "$cert" --tls-key "$key" "$@"
fi
exec "$refitd" --node "$node" "$@"
