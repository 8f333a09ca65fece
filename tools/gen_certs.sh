#!/usr/bin/env bash
# Makes a cluster's TLS material with openssl (tests, and a first deployment: docs/SECURITY.md).
#   bash tools/gen_certs.sh DIR [NODES] [EXTRA_NAME...]
# NODES: a count (nodes 0..NODES-1; default 4) or a comma-separated list of node indices
# ("0,1,1000"; one index alone as "1000,").
# DIR/ca.pem, ca.key: the cluster CA. For each node N:
# DIR/node-N.pem, node-N.key (CN refit-node-N, DNS SANs refit-node-N and refitd: every daemon
# answers to the server name clients check). DIR/refit-operator.pem|.key, DIR/refit-viewer.pem|.key:
# client certificates. Each EXTRA_NAME gets DIR/EXTRA_NAME.pem|.key signed by the same CA.
# DIR/rogue/: a second CA and a refit-node-0 and refit-operator it signs (for attack tests).
set -euo pipefail
dir=${1:?usage: gen_certs.sh DIR [NODES] [EXTRA_NAME...]}
nodes=${2:-4}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$dir/rogue"
days=3650

make_ca() {  # DIR NAME
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/CN=$2" -keyout "$1/ca.key" -out "$1/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

make_cert() {  # CADIR OUTBASE CN [SAN...]
  local cadir=$1 out=$2 cn=$3; shift 3
  local san="DNS:$cn"
  for s in "$@"; do san="$san,DNS:$s"; done
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
    -keyout "$out.key" -out "$out.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$san" > "$out.ext"
  openssl x509 -req -in "$out.csr" -CA "$cadir/ca.pem" -CAkey "$cadir/ca.key" -CAcreateserial \
    -days "$days" -extfile "$out.ext" -out "$out.pem" 2>/dev/null
  rm -f "$out.csr" "$out.ext"
  chmod 600 "$out.key"
}

make_ca "$dir" refit-test-ca
if [[ $nodes == *,* ]]; then
  IFS=, read -r -a indices <<<"$nodes"
else
  indices=()
  for ((n = 0; n < nodes; n++)); do indices+=("$n"); done
fi
for n in "${indices[@]}"; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "gen_certs.sh: \"$n\" is not a node index" >&2; exit 2; }
  make_cert "$dir" "$dir/node-$n" "refit-node-$n" refitd
done
make_cert "$dir" "$dir/refit-operator" refit-operator
make_cert "$dir" "$dir/refit-viewer" refit-viewer
for name in "$@"; do make_cert "$dir" "$dir/$name" "$name"; done
make_ca "$dir/rogue" refit-rogue-ca
make_cert "$dir/rogue" "$dir/rogue/node-0" refit-node-0 refitd
make_cert "$dir/rogue" "$dir/rogue/refit-operator" refit-operator
