#!/usr/bin/env bash
# Make what docker-compose.yml mounts, for a deployment of your own:
#   deploy/certs/ca/       the CAs and their keys (mounted nowhere; keep them safe);
#   deploy/certs/nats/     for nats-server: its certificate (nats-1..3), the CA
#                          of its clients, the routes' own CA and certificate;
#   deploy/certs/services/ for the services: their client certificate for NATS,
#                          the CA of nats-server's, the gRPC server certificate;
#   deploy/certs/gateway/  for the gateway: the CA of the engine's certificate,
#                          and its own HTTPS certificate and key;
#   deploy/secrets/        the services' nkey seed (nats-user.nk);
# and print the line to put in .env (the nkey's public key).
# Usage: deploy/make-certs.sh [DAYS]   (default 365). Existing files are kept.
#
# Needs openssl, and Python with the nkeys package (for the nkey): $PYTHON
# when set, else the repository's .venv (`make setup`) when there is one, else
# python3 on PATH (`pip install 'dagnats[server]'` brings nkeys). Both are
# checked before anything is written.
#
# Every key and the seed are written 0600 in directories of their owner:
# the containers of docker-compose.yml run as root and read them through
# their bind mounts. Certificates are 0644. With a `user:` in compose or a
# daemon that remaps users, give the keys that user's group and mode 0640.
set -euo pipefail
cd "$(dirname "$0")"
days=${1:-365}

fail() { echo "deploy/make-certs.sh: $*" >&2; exit 1; }
command -v openssl >/dev/null || fail "needs openssl on PATH (apt-get install openssl)"
if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif [[ -x ../.venv/bin/python ]]; then
  python=../.venv/bin/python
else
  python=$(command -v python3 || command -v python || true)
fi
[[ -n $python ]] || fail "needs Python with nkeys: none on PATH (set PYTHON=...)"
"$python" -c 'import nkeys' 2>/dev/null || fail "needs Python with the nkeys package, \
which $python lacks: run 'make setup' in the repository (the script then uses \
.venv/bin/python), 'pip install nkeys', or set PYTHON to a Python that has it"

umask 077 # keys and the seed are their owner's from the first byte
mkdir -p certs/ca certs/nats certs/services certs/gateway secrets
chmod 755 certs certs/nats certs/services certs/gateway

ca() { # name subject
  [[ -f certs/ca/$1.pem ]] && return
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/CN=$2" -keyout "certs/ca/$1.key" -out "certs/ca/$1.pem" 2>/dev/null
}

leaf() { # dir/name ca subject-alt-names extended-key-usage
  [[ -f certs/$1.pem ]] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=${1#*/}" \
    -keyout "certs/$1.key" -out "certs/$1.csr" 2>/dev/null
  openssl x509 -req -in "certs/$1.csr" -CA "certs/ca/$2.pem" -CAkey "certs/ca/$2.key" \
    -CAcreateserial -days "$days" -out "certs/$1.pem" \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$3" "$4") 2>/dev/null
  rm "certs/$1.csr"
}

nodes="DNS:nats-1,DNS:nats-2,DNS:nats-3,DNS:localhost,IP:127.0.0.1"
ca ca "dagnats CA"
ca route-ca "dagnats route CA"
engines="DNS:dagnats,DNS:dagnats-1,DNS:dagnats-2,DNS:dagnats-3,DNS:engine,DNS:engine-2,DNS:journal,DNS:inputs,DNS:localhost,IP:127.0.0.1"
leaf nats/nats-server ca "$nodes" serverAuth
leaf nats/route route-ca "$nodes" "serverAuth,clientAuth"
leaf services/services ca "DNS:dagnats-services" clientAuth
leaf services/engine ca "$engines" serverAuth
leaf gateway/gateway ca "DNS:gateway,DNS:localhost,IP:127.0.0.1" serverAuth
for copy in nats/ca services/ca gateway/ca; do
  cp certs/ca/ca.pem "certs/$copy.pem"
done
cp certs/ca/route-ca.pem certs/nats/route-ca.pem
chmod 644 certs/nats/*.pem certs/services/*.pem certs/gateway/*.pem
# Also those an earlier run of this script left readable by everyone.
chmod 700 certs/ca secrets
chmod 600 certs/*/*.key

if [[ ! -f secrets/nats-user.nk ]]; then
  "$python" -c 'import nkeys, os, sys; sys.stdout.buffer.write(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))' \
    > secrets/nats-user.nk
fi
chmod 600 secrets/nats-user.nk
public=$("$python" -c 'import nkeys, sys; print(nkeys.from_seed(bytearray(open(sys.argv[1], "rb").read().strip())).public_key.decode())' secrets/nats-user.nk)
echo "DAGNATS_NATS_NKEY_PUBLIC=$public"
