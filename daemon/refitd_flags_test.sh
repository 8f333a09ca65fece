#!/usr/bin/env bash
# refitd's command line and config file as an operator meets them: a bad --log-level or
# --log-format, an unknown key in the --config file (named with the file) get one line and exit
# code 2; --log-format json writes one JSON object a line; text lines carry the date.
set -uo pipefail
refitd=daemon/refitd
tmp=$(mktemp -d /tmp/refitd-flags.XXXXXX)
trap 'kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
pid=
fail() { echo "FAIL: $*"; exit 1; }

expect_refusal() {  # WHAT PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  out=$("$refitd" "$@" 2>&1); rc=$?
  [ "$rc" -eq 2 ] || fail "$what: exit $rc, not 2: $out"
  echo "$out" | grep -q -- "$pattern" || fail "$what: $out"
  [ "$(echo "$out" | wc -l)" -eq 1 ] || fail "$what: not one line: $out"
}
expect_refusal "log level" '--log-level "verbose" is not one of' --log-level verbose
expect_refusal "log format" '--log-format "yaml" is not text or json' --log-format yaml
expect_refusal "arm rounds" '--arm-rounds must be never, auto or always, not "sometimes"' --arm-rounds sometimes
echo '{"node": 1, "heartbeet": 0.5}' >"$tmp/bad.json"
expect_refusal "config key" "$tmp/bad.json: unknown key \"heartbeet\"" --config "$tmp/bad.json"
echo '{"node": "abc"}' >"$tmp/badvalue.json"
expect_refusal "config value" "$tmp/badvalue.json: flag --node: cannot use \"abc\"" --config "$tmp/badvalue.json"
echo '[1, 2]' >"$tmp/array.json"
expect_refusal "config not an object" "$tmp/array.json: not a JSON object" --config "$tmp/array.json"
echo '{"node": 0, "log-format": "json"}' >"$tmp/good.json"

# Transport security: without TLS only loopback listeners; TLS files all or none.
expect_refusal "routable without TLS" "--listen 10.1.2.3:7070 is not a loopback address and no TLS is configured" \
  --listen 10.1.2.3:7070
expect_refusal "routable data plane without TLS" "--data-listen 0.0.0.0:7071 is not a loopback address" \
  --data-listen 0.0.0.0:7071
expect_refusal "TLS files partly" "--tls-cert, --tls-key and --tls-ca go together" --tls-cert "$tmp/none.pem"
expect_refusal "TLS file unreadable" "cannot read TLS file $tmp/none.pem" \
  --tls-cert "$tmp/none.pem" --tls-key "$tmp/none.key" --tls-ca "$tmp/none.ca"
expect_refusal "worker uid" '--worker-uids: "root" is not a uid' --worker-uids root
out=$("$refitd" --check-config --listen 10.1.2.3:7070 --insecure-listen 2>&1) || fail "--insecure-listen: $out"
echo "$out" | grep -q "no TLS, and --insecure-listen" || fail "--check-config: $out"
# A setting that is valid but known to misbehave is named, not refused: an rpc keepalive below the
# 5 s an idle gRPC client takes to answer a ping.
out=$("$refitd" --check-config --rpc-keepalive 2 2>&1) || fail "--rpc-keepalive 2: $out"
echo "$out" | grep -q "^warning: --rpc-keepalive 2s is below 8s" || fail "--rpc-keepalive 2: $out"
out=$("$refitd" --check-config 2>&1) || fail "--check-config: $out"
echo "$out" | grep -q "^warning:" && fail "the defaults warned: $out"
# The certificate itself is checked: its names, its key, its CA (daemon/security/certificate_check.h).
bash tools/gen_certs.sh "$tmp/certs" 2 refit-node-5 >/dev/null 2>&1 || fail "tools/gen_certs.sh"
c=$tmp/certs
out=$("$refitd" --check-config --node 1 --listen 10.1.2.3:7070 --tls-cert "$c/node-1.pem" --tls-key "$c/node-1.key" \
  --tls-ca "$c/ca.pem" 2>&1) || fail "--check-config with TLS: $out"
echo "$out" | grep -q "TLS: certificate $c/node-1.pem" || fail "--check-config with TLS: $out"
expect_refusal "certificate without refitd" "--tls-cert $c/refit-node-5.pem lacks the DNS name refitd" \
  --check-config --node 5 --tls-cert "$c/refit-node-5.pem" --tls-key "$c/refit-node-5.key" --tls-ca "$c/ca.pem"
expect_refusal "another node's certificate" "is not node 0's" \
  --check-config --node 0 --tls-cert "$c/node-1.pem" --tls-key "$c/node-1.key" --tls-ca "$c/ca.pem"
expect_refusal "another CA's certificate" "does not verify against --tls-ca" \
  --check-config --node 0 --tls-cert "$c/rogue/node-0.pem" --tls-key "$c/rogue/node-0.key" --tls-ca "$c/ca.pem"
touch "$tmp/c.pem" "$tmp/k.pem" "$tmp/a.pem"
expect_refusal "empty certificate" "--tls-cert $tmp/c.pem: no PEM certificate" \
  --check-config --tls-cert "$tmp/c.pem" --tls-key "$tmp/k.pem" --tls-ca "$tmp/a.pem"

# A coordinator that serves, then stops: its log lines.
run() {  # LOG ARGS...
  local log=$1; shift
  "$refitd" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --worker-socket "$tmp/s.sock" --state-file "" \
    --address-file "$tmp/addr" "$@" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -s "$tmp/addr" ] && break; sleep 0.1; done
  [ -s "$tmp/addr" ] || fail "refitd did not start: $(cat "$log")"
  kill $pid; wait $pid 2>/dev/null; pid=; rm -f "$tmp/addr"
}
run "$tmp/json.log" --config "$tmp/good.json"
n=0
while read -r line; do
  /usr/bin/python3 -c 'import json,sys; o=json.loads(sys.argv[1]); assert {"time","level","logger","node","message"} <= o.keys(), o; assert o["node"] == 0' "$line" \
    || fail "not a JSON log object: $line"
  n=$((n + 1))
done <"$tmp/json.log"
[ "$n" -ge 2 ] || fail "only $n JSON lines: $(cat "$tmp/json.log")"
run "$tmp/text.log"
grep -Eq '^\[20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-9:.]+Z\] \[rpc\] \[info\] node 0 serving' "$tmp/text.log" \
  || fail "text lines carry no date: $(head -3 "$tmp/text.log")"
echo PASS
