#!/usr/bin/env bash
# Makes a private certificate authority, a server certificate and a client
# certificate for `lamina serve --tls-cert/--tls-key/--tls-ca`, with openssl.
#
#   tools/make-tls-certs.sh DIR [HOST...]
#
# DIR gets the file names libnbd (nbds:// URIs, tls-certificates=DIR) and QEMU
# (tls-creds-x509,dir=DIR) look for: ca-cert.pem, client-cert.pem, client-key.pem;
# and for the server: server-cert.pem, server-key.pem. The server certificate is
# valid for each HOST (default: localhost 127.0.0.1 ::1); clients check the name
# they connect to against it. Keys are written readable by the owner only.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
dir=$1
shift
hosts=("$@")
[ ${#hosts[@]} -gt 0 ] || hosts=(localhost 127.0.0.1 ::1)
command -v openssl >/dev/null || { echo "make-tls-certs: openssl is not installed" >&2; exit 1; }
mkdir -p "$dir"
cd "$dir"
umask 077
san=""
for h in "${hosts[@]}"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
done
san=${san%,}
days=3650
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
key ca-key.pem
openssl req -x509 -new -key ca-key.pem -out ca-cert.pem -days $days -subj "/CN=Lamina CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
# QEMU (GnuTLS) wants keyEncipherment on both end certificates.
leaf() { # name subject extensions
  key "$1-key.pem"
  openssl req -new -key "$1-key.pem" -subj "$2" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
    -days $days -out "$1-cert.pem" -extfile <(printf '%s\n' "$3" \
    "keyUsage=critical,digitalSignature,keyEncipherment" "basicConstraints=CA:FALSE") 2>/dev/null
  rm -f "$1.csr"
}
leaf server "/CN=${hosts[0]}" "subjectAltName=$san
extendedKeyUsage=serverAuth"
leaf client "/CN=lamina-client" "extendedKeyUsage=clientAuth"
rm -f ca-cert.srl
chmod 644 ca-cert.pem server-cert.pem client-cert.pem
echo "make-tls-certs: wrote ca-cert.pem, server-{cert,key}.pem, client-{cert,key}.pem in $(pwd) for ${hosts[*]}"
