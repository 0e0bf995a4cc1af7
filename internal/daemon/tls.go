package daemon

import (
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"os"
)

// TLSFiles name a certificate, its key, and the CA whose certificates peers must present:
// the flags -<prefix>-cert, -<prefix>-key and -<prefix>-ca.
type TLSFiles struct {
	Cert, Key, CA string
	prefix        string // the flags' prefix, for errors
}

// Flags binds -<prefix>-cert, -<prefix>-key and -<prefix>-ca, for what (said in their help).
func (t *TLSFiles) Flags(fs *flag.FlagSet, prefix, what string) {
	t.prefix = prefix
	fs.StringVar(&t.Cert, prefix+"-cert", t.Cert, what+": the certificate (with -"+prefix+"-key and -"+prefix+"-ca); peers must then present one from the CA")
	fs.StringVar(&t.Key, prefix+"-key", t.Key, what+": the certificate's private key")
	fs.StringVar(&t.CA, prefix+"-ca", t.CA, what+": the CA peers' certificates must come from")
}

// Config is TLSConfig of the three files.
func (t TLSFiles) Config() (*tls.Config, error) { return TLSConfig(t.prefix, t.Cert, t.Key, t.CA) }

// TLSConfig builds a mutual-TLS configuration from a certificate, key and CA file given by
// the flags -<prefix>-cert, -key and -ca: it presents the certificate, requires the peer's to
// come from the CA, and checks a server's against the CA too. All three empty: nil (no TLS);
// some but not all: an error.
func TLSConfig(prefix, certFile, keyFile, caFile string) (*tls.Config, error) {
	if certFile == "" && keyFile == "" && caFile == "" {
		return nil, nil
	}
	if certFile == "" || keyFile == "" || caFile == "" {
		return nil, fmt.Errorf("-%[1]s-cert, -%[1]s-key and -%[1]s-ca go together", prefix)
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("TLS CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("TLS CA %s: no certificate in it", caFile)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}, nil
}
